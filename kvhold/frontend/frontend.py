"""Client-facing frontend: admission into the journal, token streams, cancel, status.

Admission validates a request completely (sampling options, token ids, context
length) and writes it to the journal before acknowledging it, so an accepted
request survives any executor death. Nothing of it blocks the event loop
(kvhold.frontend.admission): a text prompt is bounded by `--max-prompt-bytes` and
tokenized on worker threads; the durable record is written by the journal's group
commit, and the request enters the shared-memory journal (runnable) and is
acknowledged only once its batch is on disk, a time slice of them per loop turn.
Admissions closed meanwhile refuse it then (SHUTTING_DOWN) and drop its record. Streams are driven by the journal, never by
the executor's word: a token is sent only once its count is published there, and
each stream remembers how many tokens it has sent. That is why a stream crosses
an executor crash with no duplicate and no gap: the replacement continues the
journal, the stream continues from its own count. Idle streams get keepalives so
a client can tell a recovery pause from a dead sidecar.

The frontend holds no sidecar: it gets the tables, the model's spec and tokenizer
directory, the durable journal, the weights fingerprint, the recovery timeline it
reports first tokens to, and a `FrontendHost` (send to a client, wake the active
executor, the sidecar's status). Handlers of other components' requests are added
with `add_handler`; the pool restart's restored streams are `restored`.
"""
from __future__ import annotations

import collections
import functools
import logging
from concurrent.futures import Future
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode, InvalidParams, InvalidTokenId, KvholdError, PromptTooLong
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState
from kvhold.protocol.leases import now_ns
from kvhold.protocol.sampling import RequestInput, SamplingParams, check_token_ids
from kvhold.protocol import structured as structured_output
from kvhold.protocol.structured import grammar_room
from kvhold.frontend import logprob_stream
from kvhold.frontend.admission import Pending, PromptTokenizer
from kvhold.frontend.detokenizer import IncrementalDetokenizer
from kvhold.frontend.gap_series import TokenGaps
from kvhold.sidecar.durable_journal import GroupCommit
from kvhold.sidecar.timeline import RecoveryTimeline

log = logging.getLogger(__name__)
KEEPALIVE_NS = 500_000_000
PUMP_NS = 50_000_000
ADMIT_SLICE_NS = 1_000_000    # durable admissions entered per loop turn: at most about this long


@dataclass(slots=True)
class Stream:
    request_id: int
    slot: int
    identity: bytes
    prompt_len: int
    detok: IncrementalDetokenizer | None
    sent: int = 0                 # generated tokens streamed (or brought as a resumed prefix)
    last_send_ns: int = 0
    last_token_ns: int = 0        # when its tokens last went out (a keepalive is not one)
    prefix: int = 0               # tokens a moved request brought: not streamed again
    text: list = field(default_factory=list)
    awaiting_resume: bool = False       # restored by a pool restart: silent until its client resumes
    restored_from: int | None = None    # tokens it was restored with, until the first new one
    failed: bool = False                # ended with an error (fail_request): silent until released
    conn: int = 0                       # the owner's connection it streams to (0: not checked)
    opened_ns: int = 0                  # admitted (for its time to first token)
    # re-run from its durable record after the pool was lost: its client may hold more tokens
    # than the record (committed tokens die with the pool), and may resume ahead of `sent`
    rerun: bool = False
    resume_at: int = 0                  # the client's next index, ahead of `sent`: sent from there


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, loaded once per process (a spare sidecar loads it before it
    is needed: kvhold.sidecar.daemon)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        log.warning("%s missing: clients must send prompt_ids and get no text", path)
        return None
    return Tokenizer.from_file(str(path))


class FrontendHost(Protocol):
    """What the frontend needs of the sidecar around it."""

    def send_client(self, client_key: bytes, msg, connection: int = 0) -> bool: ...   # False: not sent
    def client_connection(self, client_key: bytes) -> int: ...   # optional: the owner's connection now
    def wake_executor(self) -> None: ...
    def post(self, callback: Callable[[], None]) -> None: ...   # run on the loop, from any thread
    def status(self) -> dict: ...


class RestoredStreams(Protocol):
    """The streams a pool restart brought back (kvhold.frontend.restore.Restore)."""

    def on_first_token(self) -> None: ...
    def park(self, st: Stream, ids: list[int], done: m.Done, logprobs: dict | None = None) -> None: ...
    def tick(self, now: int) -> None: ...


class Frontend:
    def __init__(self, tables, spec, model_dir, *, runs_model: bool, durable, fingerprint: str,
                 timeline: RecoveryTimeline, host: FrontendHost, max_prompt_bytes: int = 1 << 20,
                 unsupported: tuple[str, ...] = (), prefix_caching: bool = False, seed: int | None = None):
        self.tables = tables
        self.journal = Journal(tables)
        self.spec = spec
        self.runs_model = runs_model        # the engine workload: executors serve requests
        self.unsupported = unsupported      # sampling fields its engine cannot honour (refused)
        # the prefix cache's figures (vLLM's prefix_cache_queries and _hits), counted from finished
        # requests: prompt tokens, and those whose KV the cache served (the journal's count)
        self.prefix_caching = prefix_caching
        # --seed: the seeds of requests that give none, drawn in admission order (else at random)
        self._seeds = random.Random(seed) if seed is not None else None
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._resets: list[tuple[bytes, int, int]] = []   # (client, tag, the count it waits for)
        self.durable = durable              # kvhold.sidecar.durable_journal.DurableJournal
        self.fingerprint = fingerprint
        self.timeline = timeline
        self.host = host
        # a host without it (a test's) does not tell connections apart: 0, never checked
        self.connection_of = getattr(host, "client_connection", lambda client_key: 0)
        self.restored: RestoredStreams | None = None
        self.model_dir = model_dir
        self.tokenizer = self._load_tokenizer(model_dir)
        if self.tokenizer is not None:
            _check_tokenizer_fits(tokenizer_top_id(str(model_dir)), spec.vocab_size, model_dir)
        self.streams: dict[int, Stream] = {}
        self._next_pump_ns = 0
        self.num_admitted = 0
        self.num_tokens = 0                                    # generated tokens streamed, in all
        self.num_prompt_tokens = 0                             # prompt tokens admitted, in all
        self.token_gaps = TokenGaps()                          # the clients' inter-token gaps, per second
        self.first_token_ms: collections.deque = collections.deque(maxlen=256)   # the latest admissions'
        self.num_finished = collections.Counter()
        self.closed: dict[str, str] = {}    # why admissions are closed, by who closed them
        self._handlers: dict[type, Callable] = {m.Generate: self.on_generate, m.Cancel: self.on_cancel,
                                                m.Status: self.on_status, m.Ping: self.on_ping,
                                                m.ResetPrefixCache: self.on_reset_prefix_cache}
        self.records: dict[int, dict] = {}   # request id -> its durable journal record (admission)
        self.prompts = PromptTokenizer(self.tokenizer, max_prompt_bytes, tables.geometry.max_seq_len)
        self._tokenizing: dict[Future, tuple[bytes, int]] = {}   # -> (client, tag)
        self.pending: dict[int, Pending] = {}     # numbered, not acknowledged: on the way to disk
        self._ready: collections.deque[Pending] = collections.deque()   # on disk: to admit
        self._durable_done: collections.deque = collections.deque()     # batches, from the commit thread
        self.commit = GroupCommit(durable, self._on_batch_written) if durable is not None else None

    def add_handler(self, msg_type: type, handler: Callable) -> None:
        """Route client messages of `msg_type` to `handler(client_key, msg)`."""
        self._handlers[msg_type] = handler

    def _vocabulary(self):
        """llguidance's tokenizer of this model (structured output's vocabulary check), built on
        the first constrained request."""
        return structured_output.vocabulary(str(Path(self.model_dir) / "tokenizer.json"), self.spec.vocab_size,
                                            tuple(sorted(self.spec.eos_token_ids)))

    @staticmethod
    def _load_tokenizer(model_dir):
        return None if model_dir is None else load_tokenizer(str(model_dir))

    def handle(self, identity: bytes, msg):
        try:
            return self._handlers[type(msg)](identity, msg)
        except KvholdError as exc:
            return m.Error(code=exc.code, message=str(exc), tag=getattr(msg, "tag", 0))

    # ------------------------------------------------------------------ admission
    def close_admissions(self, by: str, reason: str) -> None:
        """Refuse new requests (SHUTTING_DOWN, retryable elsewhere) until `by` reopens;
        requests already admitted run to completion. Health actions (reopened by the operator,
        `kvhold admissions --reopen`) and pool restarts (which re-execute the sidecar) use it."""
        if by not in self.closed:
            log.warning("admissions closed by %s: %s", by, reason)
        self.closed[by] = reason

    def open_admissions(self, by: str) -> None:
        if self.closed.pop(by, None) is not None:
            log.info("admissions reopened by %s", by)

    def _refusal(self, tag: int):
        if self.closed:
            return m.Error(code=ErrorCode.SHUTTING_DOWN, tag=tag,
                           message="not admitting new requests: " + "; ".join(self.closed.values()))
        if not self.runs_model:
            return m.Error(code=ErrorCode.INVALID_PARAMS, tag=tag,
                           message="this sidecar runs no model (workload is not 'engine')")
        return None

    def on_generate(self, identity: bytes, msg: m.Generate):
        refusal = self._refusal(msg.tag)
        if refusal is not None:
            return refusal
        # every field's type and range (kvhold.protocol.sampling) before anything is written
        req = RequestInput.check(msg.prompt, msg.prompt_ids, msg.prefix_generated, msg.params,
                                 vocab_size=self.spec.vocab_size)
        if req.prompt is not None:
            if self.tokenizer is None:
                raise InvalidParams("this model has no tokenizer.json: send prompt_ids")
            future = self.prompts.submit(req.prompt, lambda f: self.host.post(
                lambda: self._tokenized(f, msg, req)))
            self._tokenizing.setdefault(future, (identity, msg.tag))
            return None     # answered once tokenized (kvhold.frontend.admission)
        return self._admit(identity, msg, req, req.prompt_ids)

    def _tokenized(self, future: Future, msg: m.Generate, req: RequestInput) -> None:
        """On the loop: a text prompt's tokens (or why it has none) are back."""
        who = self._tokenizing.pop(future, None)
        if who is None:
            return          # answered already (the sidecar is stopping)
        identity = who[0]
        try:
            # a tokenizer's added tokens must fit the model too
            ids = check_token_ids(list(future.result()), "prompt", self.spec.vocab_size,
                                  label="token id of the tokenized prompt")
            reply = self._admit(identity, msg, req, ids)
        except KvholdError as exc:
            reply = m.Error(code=exc.code, message=str(exc), tag=msg.tag)
        except Exception as exc:   # a bug on one request must not stop the service
            log.exception("internal error admitting a text prompt")
            reply = m.Error(code=ErrorCode.INTERNAL, tag=msg.tag,
                            message=f"internal error: {type(exc).__name__}")
        if reply is not None:
            self.host.send_client(identity, reply)

    def _admit(self, identity: bytes, msg: m.Generate, req: RequestInput, prompt_ids: list[int]):
        """Number the request and queue its durable record; None (it is answered once on disk)."""
        refusal = self._refusal(msg.tag)   # admissions may have closed while it was tokenized
        if refusal is not None:
            return refusal
        if not prompt_ids:
            raise InvalidParams("the prompt is empty")
        params, prefix = req.sampling, req.prefix
        self._check_fits(prompt_ids, params)
        if self.journal.num_free_slots() <= len(self.pending):
            return m.Error(code=ErrorCode.OVERLOADED, tag=msg.tag,
                           message=f"all {self.tables.geometry.num_slots} request slots are in use")
        request_id = self.journal.new_request_id()
        if params.seed is None:
            seed = self._seeds.getrandbits(63) if self._seeds is not None else secrets.randbits(63)
        else:
            seed = params.seed
        params = params.as_journaled(seed)
        body = self._record(request_id, identity, prompt_ids, prefix, params)
        self.pending[request_id] = Pending(identity=identity, tag=msg.tag, request_id=request_id,
                                           prompt_ids=prompt_ids, prefix=prefix, params=params, body=body)
        self.commit.submit(body)
        return None

    def _on_batch_written(self, name: str | None, request_ids: list[int], error: OSError | None) -> None:
        """On the commit thread: a batch is on disk (or was refused). The loop takes it from here."""
        self._durable_done.append((name, request_ids, error))
        self.host.post(self._on_durable)

    def _on_durable(self, finish: bool = False) -> None:
        """On the loop: batches on disk become ready (entered by `tick`, a slice per turn)."""
        while self._durable_done:
            name, request_ids, error = self._durable_done.popleft()
            if error is None:
                self.durable.committed(name, request_ids)
            for rid in request_ids:
                p = self.pending.get(rid)
                if p is None:
                    continue
                if error is None:
                    self._ready.append(p)
                    continue
                del self.pending[rid]
                self.host.send_client(p.identity, m.Error(
                    code=ErrorCode.OVERLOADED, tag=p.tag,
                    message=f"cannot journal the request durably ({error}); retry later"))
        if finish:
            self._admit_ready(budget_ns=None)

    def _admit_ready(self, budget_ns: int | None = ADMIT_SLICE_NS) -> None:
        """Admit requests whose record is on disk: a slice per loop turn, so that the turn stays short."""
        if not self._ready:
            return
        deadline = now_ns() + budget_ns if budget_ns is not None else None
        admitted = 0
        while self._ready and (deadline is None or not admitted or now_ns() < deadline):
            p = self._ready.popleft()
            del self.pending[p.request_id]
            refusal = self._refusal(p.tag)
            slot = self.journal.free_slot() if refusal is None else None
            if slot is None:       # closed meanwhile (no slot can lack: pending ones hold theirs)
                self.durable.remove(p.request_id)
                self.host.send_client(p.identity, refusal or m.Error(
                    code=ErrorCode.OVERLOADED, tag=p.tag, message="no request slot is free"))
                continue
            try:
                self.journal.admit(slot, p.request_id, p.prompt_ids, p.params, prefix_ids=p.prefix)
            except Exception as exc:   # a bug on one request must not stop the service
                log.exception("internal error admitting request %#x", p.request_id)
                self.durable.remove(p.request_id)
                self.host.send_client(p.identity, m.Error(code=ErrorCode.INTERNAL, tag=p.tag,
                                                          message=f"internal error: {type(exc).__name__}"))
                continue
            self.records[p.request_id] = dict(p.body, generated=[])
            self._open_stream(p.request_id, slot, p.identity, p.prompt_ids, p.prefix)
            self.num_admitted += 1
            self.num_prompt_tokens += len(p.prompt_ids)
            admitted += 1
            self.host.send_client(p.identity, m.Accepted(tag=p.tag, request_id=p.request_id,
                                                         prompt_tokens=len(p.prompt_ids)))
        if admitted:
            self._wake_executor()

    def finish_pending(self) -> None:
        """At a stop, once the loop has ended: every admission not acknowledged yet is refused
        (SHUTTING_DOWN: the client may retry elsewhere) and its record dropped, since it was
        never accepted. Requests already admitted are left to the drain."""
        self.close_admissions("stop", "the sidecar is stopping")
        for identity, tag in self._tokenizing.values():
            self.host.send_client(identity, self._refusal(tag))
        self._tokenizing.clear()
        self.prompts.close()
        if self.commit is None:
            return
        self.commit.close()             # the batch being written finishes; the rest is not written
        self._on_durable(finish=True)        # refuses what is on disk, and removes its records
        for p in self.pending.values():
            self.host.send_client(p.identity, self._refusal(p.tag))
        self.pending.clear()

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The request fits the context and its stop ids the vocabulary."""
        max_seq = self.tables.geometry.max_seq_len
        if len(prompt_ids) >= max_seq:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens does not fit the context of "
                                f"{max_seq} tokens")
        if len(prompt_ids) + params.max_tokens > max_seq:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                f"exceeds the context of {max_seq} tokens")
        limit = self.tables.geometry.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            # with no logprob area (limit 0) even k = 0, the token's own log-prob, has nowhere to go
            if k is not None and (k > limit or not limit):
                raise InvalidParams(f"{name}={k} exceeds this server's limit of {limit} (--max-logprobs)"
                                    if limit else f"{name}: this server computes no log-probs "
                                    "(--max-logprobs 0, or a workload that runs no model)")
        name = params.first_set(self.unsupported)
        if name is not None:
            raise InvalidParams(f"{name} is not supported by this sidecar's engine")
        if params.structured is not None:
            room = grammar_room(self.tables.geometry.max_extra_bytes)
            if not room:
                raise InvalidParams("structured output: this server takes none (--max-grammar-bytes 0, "
                                    "or a workload other than the engine)")
            if self.tokenizer is None:
                raise InvalidParams("structured output: the checkpoint has no tokenizer.json to match "
                                    "a grammar with")
            size = len(params.structured[1].encode("utf-8", "surrogatepass"))
            if size > room:
                raise InvalidParams(f"the structured output's {params.structured[0]} ({size} bytes) exceeds "
                                    f"this server's limit of {room} bytes (--max-grammar-bytes)")
            structured_output.check(params.structured)
            structured_output.check_on_vocabulary(params.structured, self._vocabulary())
        if params.logit_bias:
            if not self.tables.geometry.max_extra_bytes:
                raise InvalidParams("logit_bias: this server takes none (a workload other than the engine)")
            bad = next((t for t, _ in params.logit_bias if t >= self.spec.vocab_size), None)
            if bad is not None:
                raise InvalidTokenId(f"logit_bias token id {bad} is outside the vocabulary "
                                     f"(size {self.spec.vocab_size})")
        vocab = self.spec.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidTokenId(f"stop token id {t} is outside the vocabulary (size {vocab})")

    def _open_stream(self, request_id: int, slot: int, identity: bytes, prompt_ids, prefix) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer else None
        for token in prefix if detok else ():   # the state of the uninterrupted run: a character
            detok.push(token)                    # the prefix left unfinished completes here
        self.streams[request_id] = Stream(request_id=request_id, slot=slot, identity=identity,
                                          prompt_len=len(prompt_ids), detok=detok,
                                          last_send_ns=now_ns(), sent=len(prefix), prefix=len(prefix),
                                          conn=self.connection_of(identity), opened_ns=now_ns())

    def _record(self, request_id, identity, prompt_ids, prefix, params: SamplingParams) -> dict:
        """The request's durable journal record (kvhold.sidecar.durable_journal), as admitted:
        `params` as journaled (what the shm journal stores and the engine samples with)."""
        return {"request_id": request_id, "generation": int(self.tables.generation),
                "client": identity.hex(), "prompt_ids": list(prompt_ids), "prefix": len(prefix),
                "generated": list(prefix), "sampling": params.to_dict(), "admitted_unix_ns": time.time_ns(),
                "fingerprint": self.fingerprint}

    def restore_stream(self, request_id, slot, identity, prompt_len, detok, texts, record,
                       rerun: bool = False) -> None:
        """A request restored by a pool restart (kvhold.frontend.restore): silent until resumed.
        `rerun`: re-admitted from its durable record, so it may be behind its client."""
        prefix = int(record.get("prefix", 0))
        self.streams[request_id] = Stream(
            request_id=request_id, slot=slot, identity=identity, prompt_len=prompt_len, detok=detok,
            sent=prefix + len(texts[prefix:]), prefix=prefix, text=list(texts[prefix:]),
            last_send_ns=now_ns(), awaiting_resume=True, restored_from=len(texts), rerun=rerun)
        self.records[request_id] = record

    def _send(self, st: Stream, msg) -> None:
        # a restored stream's client may not be connected yet; a stream whose owner is not
        # connected as itself (kvhold.frontend.client_peers), or is connected anew (a restarted
        # process that does not know the stream), waits for it to resume, like one
        if st.awaiting_resume:
            return
        sent = self.host.send_client(st.identity, msg, st.conn) if st.conn else self.host.send_client(st.identity, msg)
        if not sent:
            st.awaiting_resume = True

    def _wake_executor(self) -> None:
        self.host.wake_executor()

    # ------------------------------------------------------------------ other requests
    def on_cancel(self, identity: bytes, msg: m.Cancel):
        st = self.streams.get(msg.request_id)
        if st is None or st.identity != identity:  # others' requests do not exist for you
            return m.Error(code=ErrorCode.NOT_FOUND, tag=msg.tag, request_id=msg.request_id,
                           message=f"no request {msg.request_id} of yours is running")
        self.journal.cancel(st.slot)
        self._wake_executor()
        return m.Cancelled(tag=msg.tag, request_id=msg.request_id)

    def on_status(self, identity: bytes, msg: m.Status):
        return m.StatusReply(tag=msg.tag, status=self.host.status())

    def on_ping(self, identity: bytes, msg: m.Ping):
        return m.Pong(tag=msg.tag, generation=self.tables.generation)

    def fail_request(self, request_id: int, slot: int, message: str) -> None:
        """End a request with REQUEST_FAILED (kvhold.sidecar.request_deaths): its client gets the
        error now; the journal entry is cancelled, so the next executor finishes it without
        running it, and released once it has."""
        log.error("%s", message)
        self.journal.cancel(slot)
        self.durable.remove(request_id)
        self.records.pop(request_id, None)
        self.num_finished["failed"] += 1
        st = self.streams.get(request_id)
        if st is None:       # no client stream (yet): one that only releases the slot
            st = self.streams[request_id] = Stream(request_id=request_id, slot=slot, identity=b"",
                                                   prompt_len=0, detok=None, awaiting_resume=True)
        elif not st.failed:
            self._send(st, m.Error(code=ErrorCode.REQUEST_FAILED, message=message, request_id=request_id))
        st.failed = True

    # ------------------------------------------------------------------ streaming
    def on_step(self, h, msg: m.StepDone):
        received_ns = now_ns()
        self.on_committed(msg.slots)
        self.timeline.step_done(h.epoch, msg.marks, received_ns)

    def on_committed(self, slots) -> None:
        """Tokens were committed for these journal slots: stream them."""
        n = len(self.journal.req)
        slots = [s for s in slots if 0 <= s < n]     # another slot number names no request
        if not slots:
            return
        reads = self.journal.stream_reads(np.array(slots, dtype=np.int64))
        streams = self.streams
        for k, rid in enumerate(reads.request_id):
            st = streams.get(rid)
            if st is not None:
                self._pump_read(st, reads, k)

    def _pump_all(self) -> None:
        """Pump every stream (the safety net: the journal is the truth, not messages)."""
        streams = list(self.streams.values())
        if not streams:
            return
        reads = self.journal.stream_reads(np.array([st.slot for st in streams], dtype=np.int64))
        for k, st in enumerate(streams):
            self._pump_read(st, reads, k)

    def _pump(self, st: Stream) -> None:
        self._pump_read(st, self.journal.stream_reads(np.array([st.slot], dtype=np.int64)), 0)

    def _pump_read(self, st: Stream, reads, k: int) -> None:
        """Stream what the journal holds for `st`, from its slot's reads (the k-th of `reads`,
        kvhold.protocol.journal.StreamReads); the tokens and log-probs are read after them."""
        state, count, reason = reads.progress(k, st.request_id)
        if st.failed:
            if state == ExecState.FINISHED:
                self.journal.release(st.slot)
                del self.streams[st.request_id]
            return
        if st.restored_from is not None and count > st.restored_from:
            st.restored_from = None
            self.restored.on_first_token()
        asked = reads.asked_logprobs(k)
        finished = state == ExecState.FINISHED
        if finished or asked == (None, None):     # with final log-probs
            sendable = count
        else:
            sendable = logprob_stream.sendable_from(asked, reads.lp_done_of(k, st.request_id),
                                                    st.prompt_len, count, finished)
        if sendable > st.sent:
            count = sendable
            now = now_ns()
            if st.sent == st.prefix and st.opened_ns:
                self.first_token_ms.append((now - st.opened_ns) / 1e6)
            self.token_gaps.note(now, now - st.last_token_ns if st.last_token_ns else None, count - st.sent)
            st.last_token_ns = now
            self.num_tokens += count - st.sent
            ids = self.journal.generated(st.slot, st.sent, count, reads.prompt_len[k])
            if st.detok:
                push = st.detok.push
                texts = [push(t) for t in ids]
            else:
                texts = [""] * len(ids)
            st.text.extend(texts)
            start = max(st.sent, st.resume_at)      # what its client already has is not sent again
            if start < count:
                lp = logprob_stream.fields(self.journal, st.slot, st.prompt_len, start, count, asked)
                skip = start - st.sent
                self._send(st, m.Tokens(request_id=st.request_id, start=start - st.prefix, ids=ids[skip:],
                                        texts=texts[skip:], **lp))
            st.sent = count
            st.last_send_ns = now_ns()
        if state == ExecState.FINISHED and count < st.resume_at:
            # a re-run ended before the index its client had: its output is not the one streamed
            self.fail_request(st.request_id, st.slot, f"request {st.request_id:#x} was re-run from its "
                              f"durable record after the pool was lost and ended at token {count}, "
                              f"before the {st.resume_at} tokens its client has: the output differs")
            return
        if state == ExecState.FINISHED:
            if st.detok:
                st.text.append(st.detok.flush())
            preempted, recomputed = self.journal.recompute_counts(st.slot)
            queue_s, prefill_s = self.journal.timings_s(st.slot)
            cached = self.journal.cached_tokens(st.slot)
            done = m.Done(
                request_id=st.request_id, finish_reason=reason.name.lower(),
                prompt_tokens=st.prompt_len, completion_tokens=count - st.prefix, text="".join(st.text),
                preemptions=preempted, recomputed_tokens=recomputed, queue_s=queue_s, prefill_s=prefill_s,
                cached_tokens=cached)
            if self.prefix_caching:
                self.prefix_cache_queries += st.prompt_len
                self.prefix_cache_hits += cached
            self._send(st, done)
            if st.awaiting_resume:
                self.restored.park(st, self.journal.generated(st.slot, st.prefix, count), done,
                                   logprob_stream.fields(self.journal, st.slot, st.prompt_len, st.prefix, count))
            self.journal.release(st.slot)
            self.durable.remove(st.request_id)
            self.records.pop(st.request_id, None)
            del self.streams[st.request_id]
            self.num_finished[reason.name.lower()] += 1

    def on_reset_prefix_cache(self, identity: bytes, msg: m.ResetPrefixCache):
        """Ask the active executor, through the tables' header, to free every idle cached page;
        the reply goes when it has (`tick`). A reset asked while no executor runs is carried out
        by the next one, and one asked of an executor that dies first by its successor."""
        if not self.prefix_caching:
            return m.Error(code=ErrorCode.INVALID_PARAMS, tag=msg.tag,
                           message="this sidecar has no prefix cache (--no-enable-prefix-caching, or a "
                                   "workload without one)")
        header = self.tables.header
        asked = int(header["prefix_reset_asked"]) + 1
        header["prefix_reset_asked"] = asked
        self._resets.append((identity, msg.tag, asked))
        self.host.wake_executor()
        return None

    def _answer_resets(self) -> None:
        done = int(self.tables.header["prefix_reset_done"])
        still = []
        for identity, tag, asked in self._resets:
            if done >= asked:
                self.host.send_client(identity, m.ResetPrefixCacheReply(tag=tag))
            else:
                still.append((identity, tag, asked))
        self._resets = still

    def tick(self, now: int) -> None:
        if self._resets:
            self._answer_resets()
        self._admit_ready()
        if now >= self._next_pump_ns:  # safety net: the journal is the truth, not messages
            self._pump_all()
            self._next_pump_ns = now + PUMP_NS
        idle: dict[bytes, list[int]] = collections.defaultdict(list)
        for st in self.streams.values():
            if now - st.last_send_ns >= KEEPALIVE_NS:
                if not st.awaiting_resume and not st.failed:
                    idle[st.identity].append(st.request_id)
                st.last_send_ns = now
        for identity, ids in idle.items():
            self.host.send_client(identity, m.Keepalive(request_ids=ids))
        self.restored.tick(now)

    def next_deadline_ns(self) -> int:
        if self._ready:
            return 0          # admissions on disk wait for the next turn's slice
        deadline = self._next_pump_ns if self.streams or self._resets else now_ns() + 1_000_000_000
        if self.streams:
            deadline = min(deadline, min(st.last_send_ns for st in self.streams.values()) + KEEPALIVE_NS)
        return deadline

    def num_waiting(self) -> int:
        """Streams admitted with no token generated yet (queued, or in their prefill)."""
        return sum(st.sent == st.prefix for st in self.streams.values())

    def prefix_cache_status(self) -> dict | None:
        """None without a prefix cache; else its counts over the requests finished since this
        frontend started, and the hit rate (None before the first prompt token)."""
        if not self.prefix_caching:
            return None
        q, h = self.prefix_cache_queries, self.prefix_cache_hits
        return {"queries": q, "hits": h, "hit_rate": h / q if q else None}

    def status(self) -> dict:
        ttft = sorted(self.first_token_ms)
        return {"requests": {"in_flight": len(self.streams), "admitted_total": self.num_admitted,
                             "finished": dict(self.num_finished),
                             "waiting": self.num_waiting(),
                             "tokens_total": self.num_tokens,
                             "first_token_ms_p50": ttft[len(ttft) // 2] if ttft else None},
                "prefix_cache": self.prefix_cache_status(),
                "token_gaps": self.token_gaps.status(),
                "recoveries": self.timeline.records(),
                "admissions": {"open": not self.closed, "closed_by": dict(self.closed),
                               "tokenizing": len(self._tokenizing),
                               "writing": len(self.pending) - len(self._ready),
                               "durable": self.durable.stats() if self.durable is not None else None}}


@functools.lru_cache(maxsize=4)
def tokenizer_top_id(model_dir: str) -> int:
    """The largest id the checkpoint's tokenizer can produce (-1 without one); reading the
    vocabulary takes ~0.1 s at 128k ids, so once per process, ahead in a spare."""
    tokenizer = load_tokenizer(model_dir)
    return -1 if tokenizer is None else max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)


def _check_tokenizer_fits(top: int, vocab_size: int, model_dir) -> None:
    """Refuse a tokenizer that can produce token ids the model has no embedding for."""
    if top >= vocab_size:
        raise ValueError(f"{model_dir}/tokenizer.json produces token ids up to {top}, but the model's "
                         f"vocab_size is {vocab_size} (config.json): text prompts could hold ids the "
                         f"model does not have; use the tokenizer the model was trained with")
