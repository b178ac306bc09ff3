"""Client-facing frontend: admission into the journal, token streams, cancel, status.

Admission validates a request completely (sampling options, token ids, context
length) and writes it to the journal before acknowledging it, so an accepted
request survives any executor death. Streams are driven by the journal, never by
the executor's word: a token is sent only once its count is published there, and
each stream remembers how many tokens it has sent. That is why a stream crosses
an executor crash with no duplicate and no gap: the replacement continues the
journal, the stream continues from its own count. Idle streams get keepalives so
a client can tell a recovery pause from a dead sidecar.
"""
from __future__ import annotations

import collections
import logging
import secrets
from dataclasses import dataclass, field

from ipc import messages as m
from ipc.errors import ErrorCode, InvalidParams, InvalidTokenId, KvholdError, PromptTooLong
from ipc.journal import Journal
from ipc.layout import ExecState
from ipc.leases import now_ns
from ipc.sampling import SamplingParams
from sidecar.detokenizer import IncrementalDetokenizer

log = logging.getLogger(__name__)
KEEPALIVE_NS = 500_000_000
PUMP_NS = 50_000_000


@dataclass(slots=True)
class Stream:
    request_id: int
    slot: int
    identity: bytes
    prompt_len: int
    detok: IncrementalDetokenizer | None
    sent: int = 0
    last_send_ns: int = 0
    text: list = field(default_factory=list)


class Frontend:
    def __init__(self, sidecar):
        self.sidecar = sidecar
        self.tables = sidecar.tables
        self.journal = Journal(sidecar.tables)
        self.spec = sidecar.spec
        self.tokenizer = self._load_tokenizer(sidecar.config.model)
        self.streams: dict[int, Stream] = {}
        self.recoveries: collections.deque = collections.deque(maxlen=64)
        self._awaiting_first_token: dict[int, dict] = {}
        self._next_pump_ns = 0
        self.num_admitted = 0
        self.num_finished = collections.Counter()
        self._handlers = {m.Generate: self.on_generate, m.Cancel: self.on_cancel,
                          m.Status: self.on_status, m.Ping: self.on_ping}

    @staticmethod
    def _load_tokenizer(model_dir):
        if model_dir is None:
            return None
        from pathlib import Path

        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            log.warning("%s missing: clients must send prompt_ids and get no text", path)
            return None
        return Tokenizer.from_file(str(path))

    def handle(self, identity: bytes, msg):
        try:
            return self._handlers[type(msg)](identity, msg)
        except KvholdError as exc:
            return m.Error(code=exc.code, message=str(exc), tag=getattr(msg, "tag", 0))

    # ------------------------------------------------------------------ admission
    def on_generate(self, identity: bytes, msg: m.Generate):
        if self.sidecar.config.workload != "engine":
            return m.Error(code=ErrorCode.INVALID_PARAMS, tag=msg.tag,
                           message="this sidecar runs no model (workload is not 'engine')")
        params = SamplingParams.from_dict(msg.params)
        prompt_ids = self._prompt_ids(msg)
        max_seq = self.tables.geometry.max_seq_len
        if len(prompt_ids) >= max_seq:
            raise PromptTooLong(f"prompt of {len(prompt_ids)} tokens does not fit the context of "
                                f"{max_seq} tokens")
        if len(prompt_ids) + params.max_tokens > max_seq:
            raise PromptTooLong(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                                f"exceeds the context of {max_seq} tokens")
        vocab = self.spec.vocab_size
        for t in params.stop_token_ids:
            if t >= vocab:
                raise InvalidTokenId(f"stop token id {t} is outside the vocabulary (size {vocab})")
        slot = self.journal.free_slot()
        if slot is None:
            return m.Error(code=ErrorCode.OVERLOADED, tag=msg.tag,
                           message=f"all {len(self.tables.requests)} request slots are in use")
        self.tables.header["request_counter"] += 1
        request_id = (self.tables.generation << 40) | int(self.tables.header["request_counter"])
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.journal.admit(slot, request_id, prompt_ids, max_tokens=params.max_tokens, seed=seed,
                           temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                           stop_ids=params.stop_token_ids, ignore_eos=params.ignore_eos)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer else None
        self.streams[request_id] = Stream(request_id=request_id, slot=slot, identity=identity,
                                          prompt_len=len(prompt_ids), detok=detok,
                                          last_send_ns=now_ns())
        self.num_admitted += 1
        self._wake_executor()
        return m.Accepted(tag=msg.tag, request_id=request_id, prompt_tokens=len(prompt_ids))

    def _prompt_ids(self, msg: m.Generate) -> list[int]:
        if (msg.prompt is None) == (msg.prompt_ids is None):
            raise InvalidParams("give exactly one of prompt (text) or prompt_ids")
        if msg.prompt is not None:
            if self.tokenizer is None:
                raise InvalidParams("this model has no tokenizer.json: send prompt_ids")
            ids = self.tokenizer.encode(msg.prompt).ids
        else:
            ids = msg.prompt_ids
            vocab = self.spec.vocab_size
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidTokenId(f"token id {bad} is outside the vocabulary (size {vocab})")
        if not ids:
            raise InvalidParams("the prompt is empty")
        return list(ids)

    def _wake_executor(self) -> None:
        active = self.sidecar.supervisor.active
        if active is not None:
            self.sidecar.send_executor(active, m.Wake())

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
        return m.StatusReply(tag=msg.tag, status=self.sidecar.status())

    def on_ping(self, identity: bytes, msg: m.Ping):
        return m.Pong(tag=msg.tag, generation=self.tables.generation)

    # ------------------------------------------------------------------ streaming
    def on_step(self, h, msg: m.StepDone):
        for slot in msg.slots:
            request_id = int(self.tables.requests["request_id"][slot]) if 0 <= slot < len(self.tables.requests) else 0
            st = self.streams.get(request_id)
            if st is not None:
                self._pump(st)
        rec = self._awaiting_first_token.pop(h.epoch, None)
        if rec is not None:
            rec["first_token_ns"] = now_ns()
            log.info("recovery complete: first resumed token %.1f ms after detection",
                     (rec["first_token_ns"] - rec.get("detect_ns", rec["first_token_ns"])) / 1e6)

    def on_recovered(self, h, msg: m.Recovered):
        if not msg.report.get("fenced_epoch"):
            return None  # a first activation, not a failover: nothing was recovered
        rec = dict(msg.report, pid=h.pid, epoch=h.epoch, received_ns=now_ns())
        self.recoveries.append(rec)
        if rec.get("requests_resumable", 0) + rec.get("requests_damaged", 0) + rec.get("requests_lost", 0):
            self._awaiting_first_token[h.epoch] = rec
        log.info("executor pid %d took over: %s", h.pid, ", ".join(
            f"{k}={v}" for k, v in msg.report.items() if not k.endswith("_ns") and k != "requests"))
        return None

    def _pump(self, st: Stream) -> None:
        state, count, reason = self.journal.progress(st.slot, st.request_id)
        if count > st.sent:
            ids = self.journal.generated(st.slot, st.sent, count)
            texts = [st.detok.push(t) for t in ids] if st.detok else [""] * len(ids)
            st.text.extend(texts)
            self.sidecar.send_client(st.identity, m.Tokens(request_id=st.request_id, start=st.sent,
                                                           ids=ids, texts=texts))
            st.sent = count
            st.last_send_ns = now_ns()
        if state == ExecState.FINISHED:
            if st.detok:
                st.text.append(st.detok.flush())
            r = self.tables.requests[st.slot]
            self.sidecar.send_client(st.identity, m.Done(
                request_id=st.request_id, finish_reason=reason.name.lower(),
                prompt_tokens=st.prompt_len, completion_tokens=count, text="".join(st.text),
                preemptions=int(r["num_preempted"]), recomputed_tokens=int(r["num_recomputed"])))
            self.journal.release(st.slot)
            del self.streams[st.request_id]
            self.num_finished[reason.name.lower()] += 1

    def tick(self, now: int) -> None:
        if now >= self._next_pump_ns:  # safety net: the journal is the truth, not messages
            for st in list(self.streams.values()):
                self._pump(st)
            self._next_pump_ns = now + PUMP_NS
        idle: dict[bytes, list[int]] = collections.defaultdict(list)
        for st in self.streams.values():
            if now - st.last_send_ns >= KEEPALIVE_NS:
                idle[st.identity].append(st.request_id)
                st.last_send_ns = now
        for identity, ids in idle.items():
            self.sidecar.send_client(identity, m.Keepalive(request_ids=ids))

    def next_deadline_ns(self) -> int:
        deadline = self._next_pump_ns if self.streams else now_ns() + 1_000_000_000
        if self.streams:
            deadline = min(deadline, min(st.last_send_ns for st in self.streams.values()) + KEEPALIVE_NS)
        return deadline

    def status(self) -> dict:
        return {"requests": {"in_flight": len(self.streams), "admitted_total": self.num_admitted,
                             "finished": dict(self.num_finished)},
                "recoveries": list(self.recoveries)[-16:]}

