"""The request journal: every in-flight request, durable across executor deaths.

One fixed record per slot (layout.REQUEST_DTYPE) plus a token row (prompt, then
generated tokens) and a page-list row. The sidecar writes the admission half and
the prompt, publishing the request by writing `admit_state` last. The executor
writes the execution half: it claims a request by writing `exec_request_id` last,
stores each generated token before bumping `num_generated` (so a count never
covers an unwritten token), and sets `exec_state=FINISHED` only after the last
token is counted. A token's log-probs (when the request asks for them and the tables have a
logprob area, layout.logprob_dtype) are stored with it, before the count; `lp_done` counts the
positions whose log-probs are final, so a recomputation (after a preemption or a pool
restart) never rewrites one a client may have seen. Fields of the execution half are meaningful only while
`exec_request_id == request_id`, so a reused slot needs no reset by the sidecar.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvhold.protocol.layout import MAX_STOP_IDS, REQUEST_DTYPE, AdmitState, ExecState, FinishReason, RequestFlag
from kvhold.protocol.errors import InvalidParams
from kvhold.protocol.leases import now_ns
from kvhold.protocol.sampling import TOKEN_ID_MAX, SamplingParams, check_token_ids
from kvhold.protocol.structured import pack_extras, unpack_extras
from kvhold.protocol.tables import Tables


@dataclass(frozen=True, slots=True)
class JournalEntry:
    """A consistent read of one slot, as recovery and the scheduler need it. `sampling`: the
    request's params as admitted (seed resolved, temperature and top_p as float32)."""

    slot: int
    request_id: int
    admit_state: AdmitState
    prompt_len: int
    sampling: SamplingParams
    taken: bool
    exec_state: ExecState
    num_generated: int
    num_pages: int
    num_prefix: int = 0      # generated tokens brought by a resumed request (see admit)
    lp_done: int = 0                     # positions whose log-probs are final (execution half)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_generated

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens


class Journal:
    def __init__(self, tables: Tables):
        self.tables = tables
        self.req = tables.requests
        self.tokens = tables.tokens
        self.page_lists = tables.page_lists
        self.max_seq_len = tables.geometry.max_seq_len

    # ------------------------------------------------------------------ sidecar
    def free_slot(self) -> int | None:
        free = (self.req["admit_state"] == AdmitState.FREE).nonzero()[0]
        return int(free[0]) if len(free) else None

    def num_free_slots(self) -> int:
        return int((self.req["admit_state"] == AdmitState.FREE).sum())

    def new_request_id(self) -> int:
        """A request id never used before: the pool generation above 40 bits of a per-pool
        counter kept in the table header (generations never repeat, see the sidecar)."""
        self.tables.header["request_counter"] += 1
        return (self.tables.generation << 40) | int(self.tables.header["request_counter"])

    def admit(self, slot: int, request_id: int, prompt_ids, sampling: SamplingParams, *,
              owner_tag: int = 0, prefix_ids=()) -> None:
        """`sampling`: the request's params, with its seed (the one the sidecar picked when the
        client gave none). `prefix_ids`: tokens already generated elsewhere (a request moved
        from another sidecar). They are stored after the prompt and count as generated from
        the start, so sampling positions and the max_tokens budget continue where the first run
        stopped. Every value is checked against its field's range (kvhold.protocol.sampling)
        before any field is written: InvalidParams (a ValueError) leaves the slot free."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if sampling.seed is None:
            raise InvalidParams("a journaled request needs its seed")
        limit = self.tables.geometry.max_logprobs if self.tables.logprobs is not None else -1
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(sampling, name)
            if k is not None and k > limit:
                raise InvalidParams(f"{name}={k} exceeds this server's limit of "
                                    f"{max(limit, 0)} (--max-logprobs)" if limit >= 0 else
                                    f"{name}: this server keeps no log-probs (--max-logprobs 0)")
        extras = pack_extras(sampling.structured, sampling.logit_bias)
        room = self.tables.geometry.max_extra_bytes
        if len(extras) > room:
            raise InvalidParams("structured output and logit_bias: this server's journal has no room for "
                                "them (a workload other than the engine)" if not room else
                                f"the structured output's spec and logit_bias ({len(extras)} bytes with their "
                                f"framing) exceed this server's room of {room} bytes (--max-grammar-bytes)")
        prompt, prefix = _token_row(prompt_ids, "prompt_ids"), _token_row(prefix_ids, "prefix_ids")
        if not 0 < len(prompt) < self.max_seq_len:
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit slot rows of {self.max_seq_len}")
        if len(prompt) + len(prefix) >= self.max_seq_len or len(prefix) >= sampling.max_tokens:
            raise ValueError(f"{len(prefix)} resumed tokens leave nothing to generate")
        r = self.req
        if r["admit_state"][slot] != AdmitState.FREE:
            raise RuntimeError(f"journal slot {slot} is not free")
        self.tokens[slot, :len(prompt)] = prompt
        self.tokens[slot, len(prompt):len(prompt) + len(prefix)] = prefix
        r["num_prefix"][slot] = len(prefix)
        r["request_id"][slot] = request_id
        r["owner_tag"][slot] = owner_tag
        r["admitted_ns"][slot] = now_ns()
        r["prompt_len"][slot] = len(prompt)
        _write_sampling(r, slot, sampling)
        if extras:
            self.tables.extras[slot, :len(extras)] = np.frombuffer(extras, np.uint8)
        r["extra_len"][slot] = len(extras)
        r["admit_state"][slot] = AdmitState.ADMITTED          # publication

    def cancel(self, slot: int) -> None:
        if self.req["admit_state"][slot] == AdmitState.ADMITTED:
            self.req["admit_state"][slot] = AdmitState.CANCELLED

    def release(self, slot: int) -> None:
        self.req["admit_state"][slot] = AdmitState.FREE

    # ------------------------------------------------------------------ readers
    def request_id_at(self, slot: int) -> int:
        """The request id admitted in `slot`, 0 for a slot number outside the journal."""
        return int(self.req["request_id"][slot]) if 0 <= slot < len(self.req) else 0

    def is_cancelled(self, slot: int) -> bool:
        """Whether the client cancelled the request in `slot`."""
        return int(self.req["admit_state"][slot]) == AdmitState.CANCELLED

    def cached_tokens(self, slot: int) -> int:
        """Prompt tokens the request found in the prefix cache (its executor's write)."""
        return int(self.req["num_cached"][slot])

    def set_cached_tokens(self, slot: int, count: int) -> None:
        self.req["num_cached"][slot] = count

    def recompute_counts(self, slot: int) -> tuple[int, int]:
        """(times preempted, tokens recomputed) of the request executing in `slot`."""
        return int(self.req["num_preempted"][slot]), int(self.req["num_recomputed"][slot])

    def entry(self, slot: int) -> JournalEntry:
        return self.entries([slot])[0]

    def entries(self, slots) -> list[JournalEntry]:
        """The entries of `slots`, from one copy of their records."""
        slots = np.asarray(slots, dtype=np.int64)
        rows = self.req[slots].tolist()            # a copy, as tuples of plain Python values
        return [_entry(slot, r, self._extras(slot, r["extra_len"]))
                for slot, r in ((slot, dict(zip(_REQUEST_FIELDS, row))) for slot, row in zip(slots.tolist(), rows))]

    def _extras(self, slot: int, length: int) -> dict:
        """The variable-length fields of the request in `slot` (kvhold.protocol.structured)."""
        area = self.tables.extras
        if not length or area is None or length > area.shape[1]:
            return _NO_EXTRAS
        return unpack_extras(area[slot, :length].tobytes())

    def is_free(self, slot: int) -> bool:
        """The slot holds no request (released, or never admitted)."""
        return int(self.req["admit_state"][slot]) == AdmitState.FREE

    def live_slots(self) -> np.ndarray:
        """Slots admitted (or cancelled) but not yet released."""
        return (self.req["admit_state"] != AdmitState.FREE).nonzero()[0]

    def holds(self, slots, request_ids, taken=False) -> np.ndarray:
        """Whether each of `slots` still holds `request_ids[k]` (admitted or cancelled, not yet
        released), and where `taken` (one bool, or one per slot) whether an executor has taken it
        too: array operations over the two records' fields, for the sidecar's bookkeeping between
        a fence and a promotion."""
        slots = np.asarray(slots, dtype=np.int64)
        r = self.req
        rid = r["request_id"][slots]
        held = (rid == np.asarray(request_ids, dtype=np.uint64)) & (r["admit_state"][slots] != AdmitState.FREE)
        return held & ((r["exec_request_id"][slots] == rid) | ~np.asarray(taken, dtype=bool))

    def live_request_ids(self) -> dict[int, int]:
        """request id -> slot of every live slot."""
        slots = self.live_slots()
        return dict(zip(self.req["request_id"][slots].tolist(), slots.tolist()))

    def untaken_slots(self) -> np.ndarray:
        """Slots admitted (or cancelled) that no executor has taken yet."""
        r = self.req
        return ((r["admit_state"] != AdmitState.FREE) & (r["exec_request_id"] != r["request_id"])).nonzero()[0]

    def cancelled(self, slots: np.ndarray) -> np.ndarray:
        """Those of `slots` whose request the sidecar cancelled."""
        return slots[self.req["admit_state"][slots] == AdmitState.CANCELLED]

    def progress(self, slot: int, request_id: int) -> tuple[ExecState, int, FinishReason]:
        """(state, tokens generated, finish reason) for a streaming reader; state first."""
        r = self.req
        if int(r["exec_request_id"][slot]) != request_id:
            return ExecState.NONE, 0, FinishReason.NONE
        state = ExecState(int(r["exec_state"][slot]))
        count = int(r["num_generated"][slot])
        reason = FinishReason(int(r["finish_reason"][slot])) if state == ExecState.FINISHED else FinishReason.NONE
        return state, count, reason

    def stream_reads(self, slots) -> "StreamReads":
        """What a streaming reader needs of each of `slots` (int64 array, within the journal), each
        field read for all of them at once, in the order `progress`, `asked_logprobs` and
        `lp_done` read it for one: the admission fields, then `exec_request_id`, `exec_state`
        before `num_generated` (a FINISHED state covers the count read after it), the finish
        reason, then `lp_done`."""
        r = self.req
        return StreamReads(r["request_id"][slots].tolist(), r["prompt_len"][slots].tolist(),
                           r["logprobs"][slots].tolist(), r["prompt_logprobs"][slots].tolist(),
                           r["exec_request_id"][slots].tolist(), r["exec_state"][slots].tolist(),
                           r["num_generated"][slots].tolist(), r["finish_reason"][slots].tolist(),
                           r["lp_done"][slots].tolist())

    def timings_s(self, slot: int) -> tuple[float | None, float | None]:
        """(queue time: admitted -> first in a step, prefill time: first in a step -> first token
        committed), in seconds, of the request executing in `slot`; None where a mark is missing
        (an engine that does not mark its steps, such as an engine bridge's)."""
        r = self.req[slot]
        admitted, scheduled, first = int(r["admitted_ns"]), int(r["scheduled_ns"]), int(r["first_token_ns"])
        queue = (scheduled - admitted) / 1e9 if admitted and scheduled >= admitted else None
        prefill = (first - scheduled) / 1e9 if scheduled and first >= scheduled else None
        return queue, prefill

    def generated(self, slot: int, start: int, end: int, prompt_len: int | None = None) -> list[int]:
        """Generated tokens [start, end) of `slot` (`prompt_len`: its prompt's, when read already)."""
        p = int(self.req["prompt_len"][slot]) if prompt_len is None else prompt_len
        return self.tokens[slot, p + start:p + end].tolist()

    def asked_logprobs(self, slot: int) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) the request in `slot` asked for (None: not asked)."""
        return _asked(self.req["logprobs"][slot]), _asked(self.req["prompt_logprobs"][slot])

    def lp_done(self, slot: int, request_id: int) -> int:
        """Token positions [0, n) whose log-probs are final (0 before an executor took it)."""
        if int(self.req["exec_request_id"][slot]) != request_id:
            return 0
        return int(self.req["lp_done"][slot])

    def logprobs_at(self, slot: int, start: int, end: int, k: int) -> tuple[list, list, list]:
        """(log-prob, top-k ids, top-k log-probs) of token positions [start, end), the top lists
        cut to `k` entries, as Python lists."""
        rows = self.tables.logprobs[slot, start:end]
        return (rows["logprob"].tolist(), rows["top_ids"][:, :k].tolist(),
                rows["top_logprobs"][:, :k].tolist())

    def ranks_at(self, slot: int, start: int, end: int) -> list[int]:
        """The rank of the token at each position of [start, end) (1: the most likely)."""
        return self.tables.logprobs["rank"][slot, start:end].tolist()

    def all_tokens(self, slot: int, num_tokens: int) -> np.ndarray:
        return self.tokens[slot, :num_tokens].copy()

    # ------------------------------------------------------------------ executor
    def take(self, slot: int, request_id: int, epoch: int) -> None:
        r = self.req
        r["num_generated"][slot] = r["num_prefix"][slot]    # a resumed request's tokens count
        r["num_pages"][slot] = 0
        r["finish_reason"][slot] = FinishReason.NONE
        r["num_preempted"][slot] = 0
        r["num_recomputed"][slot] = 0
        r["num_cached"][slot] = 0
        r["first_token_ns"][slot] = 0
        r["finished_ns"][slot] = 0
        r["scheduled_ns"][slot] = 0
        r["exec_epoch"][slot] = epoch
        r["step_epoch"][slot] = 0
        # positions before it need no log-probs: the first has none, and without prompt_logprobs
        # neither do the prompt's nor a resumed request's tokens (never streamed again)
        r["lp_done"][slot] = 1 if r["prompt_logprobs"][slot] else r["prompt_len"][slot] + r["num_prefix"][slot]
        r["exec_state"][slot] = ExecState.RUNNING
        r["exec_request_id"][slot] = request_id              # publication

    def restore_progress(self, slot: int, request_id: int, generated) -> None:
        """Pool restart: an admitted request continues with `generated` tokens already committed
        and no KV. The one exception to the single-writer rule: the sidecar writes this execution
        half into a fresh segment before any executor has attached. The first active executor's
        takeover then finds a taken request with no pages and recomputes its KV by prefill."""
        gen = np.asarray(generated, dtype=np.int32)
        p = int(self.req["prompt_len"][slot])
        if p + len(gen) > self.max_seq_len:
            raise ValueError(f"{p} + {len(gen)} tokens do not fit slot rows of {self.max_seq_len}")
        self.tokens[slot, p:p + len(gen)] = gen
        self.take(slot, request_id, epoch=0)
        if not self.req["prompt_logprobs"][slot]:    # the restored tokens' log-probs are recomputed
            self.req["lp_done"][slot] = p
        self.req["num_generated"][slot] = len(gen)

    def write_logprobs(self, slots: np.ndarray, positions: np.ndarray, logprobs: np.ndarray,
                       top_ids: np.ndarray, top_logprobs: np.ndarray, lp_done: np.ndarray,
                       ranks: np.ndarray | None = None) -> None:
        """Store log-probs (and the tokens' ranks, when given) at absolute positions (the top
        lists' width at most the area's), then publish each slot's new `lp_done` (the slots' last
        values win)."""
        area, k = self.tables.logprobs, top_ids.shape[1]
        area["logprob"][slots, positions] = logprobs
        if ranks is not None:
            area["rank"][slots, positions] = ranks
        if k:
            area["top_ids"][slots, positions, :k] = top_ids
            area["top_logprobs"][slots, positions, :k] = top_logprobs
        self.req["lp_done"][slots] = lp_done

    def commit_tokens(self, slots: np.ndarray, positions: np.ndarray, token_ids: np.ndarray,
                      new_counts: np.ndarray, logprobs=None) -> None:
        """Store tokens at absolute positions (and their log-probs: `logprobs`, the arguments of
        write_logprobs for the rows that asked for them), then publish the new generated counts."""
        if logprobs is not None:
            self.write_logprobs(*logprobs)
        self.tokens[slots, positions] = token_ids
        first = self.req["first_token_ns"][slots] == 0     # reset by take()
        if first.any():
            self.req["first_token_ns"][slots[first]] = now_ns()
        self.req["num_generated"][slots] = new_counts

    def finish(self, slot: int, reason: FinishReason) -> None:
        r = self.req
        r["finish_reason"][slot] = reason
        r["finished_ns"][slot] = now_ns()
        r["exec_state"][slot] = ExecState.FINISHED

    def num_pages(self, slot: int) -> int:
        """How many KV pages the slot's page list names."""
        return int(self.req["num_pages"][slot])

    def set_num_pages(self, slot: int, count: int) -> None:
        self.req["num_pages"][slot] = count

    def pages_of(self, slot: int, count: int) -> np.ndarray:
        """The first `count` pages of the slot's list (all of it if `count` exceeds it)."""
        return self.page_lists[slot, :count].astype(np.int64)

    def mark_step(self, slots: np.ndarray, epoch: int, step: int, starts: np.ndarray,
                  ends: np.ndarray) -> None:
        """The requests in `slots` are in step `step` of the executor of `epoch`, which computes
        their KV positions [starts, ends). Written before the step runs; a request's first step
        also stamps its `scheduled_ns` (the end of its queue time; kept across takeovers)."""
        r = self.req
        first = r["scheduled_ns"][slots] == 0          # reset by take()
        if first.any():
            r["scheduled_ns"][slots[first]] = now_ns()
        r["step_epoch"][slots] = epoch
        r["step_seq"][slots] = step
        r["step_start"][slots] = starts
        r["step_end"][slots] = ends

    def in_step(self, epoch: int, step: int) -> list[tuple[int, int, int, int]]:
        """(slot, request id, KV start, KV end) of every unfinished request marked in that step."""
        r = self.req
        hit = ((r["admit_state"] != AdmitState.FREE) & (r["exec_request_id"] == r["request_id"])
               & (r["exec_state"] != ExecState.FINISHED)
               & (r["step_epoch"] == epoch) & (r["step_seq"] == step)).nonzero()[0]
        return [(int(s), int(r["request_id"][s]), int(r["step_start"][s]), int(r["step_end"][s]))
                for s in hit]

    def add_counter(self, slot: int, field: str, amount: int) -> None:
        self.req[field][slot] += amount

    def set_pages(self, slot: int, pages, first: int = 0) -> None:
        """List `pages` as the slot's KV pages from position `first` on (those before it stay),
        then publish the new count."""
        self.page_lists[slot, first:first + len(pages)] = pages
        self.req["num_pages"][slot] = first + len(pages)

    def truncate_page_lists(self, slots: np.ndarray, counts: np.ndarray) -> None:
        """List at most `counts[k]` pages for `slots[k]` (a takeover, before it releases or
        quarantines the pages after them)."""
        slots = np.asarray(slots, dtype=np.int64)
        self.req["num_pages"][slots] = np.minimum(self.req["num_pages"][slots], counts)

    def replace_pages(self, slots: np.ndarray, positions: np.ndarray, pages: np.ndarray) -> None:
        """List `pages[k]` at `positions[k]` of `slots[k]`'s list, in place of the page there (a
        takeover's copy of a tail page), the counts unchanged."""
        self.page_lists[np.asarray(slots, dtype=np.int64), np.asarray(positions, dtype=np.int64)] = pages

    def set_page_lists(self, slots: np.ndarray, lists: list[list[int]]) -> None:
        """`set_pages(slot, pages)` for many slots at once (distinct ones): every list is written,
        then every count published."""
        lens = np.fromiter(map(len, lists), dtype=np.int64, count=len(lists))
        flat = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lens.sum()))
        self.page_lists[np.repeat(slots, lens), segment_positions(lens)] = flat
        self.req["num_pages"][slots] = lens


_REQUEST_FIELDS = REQUEST_DTYPE.names
_NO_EXTRAS = unpack_extras(b"")          # shared, read only
_ADMIT_STATES = {int(v): v for v in AdmitState}
_EXEC_STATES = {int(v): v for v in ExecState}
_FINISH_REASONS = {int(v): v for v in FinishReason}
_IGNORE_EOS = int(RequestFlag.IGNORE_EOS)


@dataclass(slots=True)
class StreamReads:
    """`Journal.stream_reads`: fields of many slots as lists of plain ints, index k for slot k."""

    request_id: list
    prompt_len: list
    logprobs: list
    prompt_logprobs: list
    exec_request_id: list
    exec_state: list
    num_generated: list
    finish_reason: list
    lp_done: list

    def progress(self, k: int, request_id: int) -> tuple[ExecState, int, FinishReason]:
        """`Journal.progress` of the k-th slot for `request_id`, from these reads."""
        if self.exec_request_id[k] != request_id:
            return ExecState.NONE, 0, FinishReason.NONE
        state = _member(_EXEC_STATES, ExecState, self.exec_state[k])      # ValueError, as progress raises
        if state != ExecState.FINISHED:
            return state, self.num_generated[k], FinishReason.NONE
        return state, self.num_generated[k], _member(_FINISH_REASONS, FinishReason, self.finish_reason[k])

    def asked_logprobs(self, k: int) -> tuple[int | None, int | None]:
        """`Journal.asked_logprobs` of the k-th slot."""
        lp, plp = self.logprobs[k], self.prompt_logprobs[k]
        return (lp - 1 if lp else None), (plp - 1 if plp else None)

    def lp_done_of(self, k: int, request_id: int) -> int:
        """`Journal.lp_done` of the k-th slot for `request_id`."""
        return self.lp_done[k] if self.exec_request_id[k] == request_id else 0


def _write_sampling(r: np.ndarray, slot: int, p: SamplingParams) -> None:
    """The record's sampling fields of `slot` := `p` (checked already)."""
    stops = p.stop_token_ids
    r["seed"][slot] = p.seed
    r["max_tokens"][slot] = p.max_tokens
    r["min_tokens"][slot] = p.min_tokens
    r["top_k"][slot] = p.top_k
    r["temperature"][slot] = p.temperature
    r["top_p"][slot] = p.top_p
    r["num_stop"][slot] = len(stops)
    r["stop_ids"][slot] = 0
    r["stop_ids"][slot, :len(stops)] = stops
    r["flags"][slot] = RequestFlag.IGNORE_EOS if p.ignore_eos else RequestFlag.NONE
    r["logprobs"][slot] = 0 if p.logprobs is None else p.logprobs + 1
    r["prompt_logprobs"][slot] = 0 if p.prompt_logprobs is None else p.prompt_logprobs + 1
    r["presence_penalty"][slot] = p.presence_penalty
    r["frequency_penalty"][slot] = p.frequency_penalty
    r["repetition_penalty"][slot] = p.repetition_penalty
    r["min_p"][slot] = p.min_p


def _member(members: dict, enum_type, value):
    """The enum member of `value` by a dict lookup, not an enum call (a takeover reads every live
    record); an unknown value still raises as the enum call does."""
    member = members.get(value)
    return member if member is not None else enum_type(value)


def _read_sampling(r: dict, extras: dict) -> SamplingParams:
    """The SamplingParams of one record's fields as plain Python values, and of its extras."""
    n_stop = min(r["num_stop"], MAX_STOP_IDS)
    return SamplingParams.from_record(
        max_tokens=r["max_tokens"], min_tokens=r["min_tokens"], seed=r["seed"],
        temperature=float(r["temperature"]), top_p=float(r["top_p"]), top_k=r["top_k"],
        stop_token_ids=tuple(r["stop_ids"][:n_stop]),
        ignore_eos=bool(r["flags"] & _IGNORE_EOS),
        logprobs=_asked(r["logprobs"]), prompt_logprobs=_asked(r["prompt_logprobs"]),
        presence_penalty=float(r["presence_penalty"]), frequency_penalty=float(r["frequency_penalty"]),
        repetition_penalty=float(r["repetition_penalty"]) or 1.0, min_p=float(r["min_p"]),
        structured=extras["structured"], logit_bias=extras["logit_bias"])


def _entry(slot: int, r: dict, extras: dict) -> JournalEntry:
    """A JournalEntry from one record's fields as plain Python values, and its extras."""
    taken = r["exec_request_id"] == r["request_id"] and r["request_id"] != 0
    return JournalEntry(
        slot=slot, request_id=r["request_id"], admit_state=_member(_ADMIT_STATES, AdmitState, r["admit_state"]),
        prompt_len=r["prompt_len"], sampling=_read_sampling(r, extras),
        taken=taken, exec_state=_member(_EXEC_STATES, ExecState, r["exec_state"]) if taken else ExecState.NONE,
        num_generated=r["num_generated"] if taken else 0,
        num_pages=r["num_pages"] if taken else 0, num_prefix=r["num_prefix"],
        lp_done=r["lp_done"] if taken else 0)


def segment_positions(lens: np.ndarray) -> np.ndarray:
    """For items listed segment after segment (`lens` items each): each item's index in its segment."""
    lens = np.asarray(lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    return np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(starts, lens)


def _asked(code) -> int | None:
    """A journal logprobs field (0: not asked, k + 1: k top ones) as the request's value."""
    return int(code) - 1 if int(code) else None


def _token_row(ids, name: str) -> np.ndarray:
    """Token ids as the journal's int32 row; InvalidParams/InvalidTokenId (ValueErrors) for any id
    outside [0, TOKEN_ID_MAX] or not an integer (vectorised; the exact check names the value)."""
    arr = np.asarray(ids) if len(ids) else np.zeros(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or (len(arr) and not 0 <= arr.min() <= arr.max() <= TOKEN_ID_MAX):
        check_token_ids(list(ids), name)
        raise ValueError(f"{name} must be a list of token ids")
    return arr.astype(np.int32)
