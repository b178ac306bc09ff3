"""Client-facing frontend: admission into the journal, token streams, cancel, status.

Admission validates a request completely (sampling options, token ids, context
length) and writes it to the journal before acknowledging it, so an accepted
request survives any executor death. Streams are driven by the journal, never by
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
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode, InvalidParams, InvalidTokenId, KvholdError, PromptTooLong
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState
from kvhold.protocol.leases import now_ns
from kvhold.protocol.sampling import RequestInput, SamplingParams
from kvhold.sidecar.detokenizer import IncrementalDetokenizer
from kvhold.sidecar.timeline import RecoveryTimeline

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
    sent: int = 0                 # generated tokens streamed (or brought as a resumed prefix)
    last_send_ns: int = 0
    prefix: int = 0               # tokens a moved request brought: not streamed again
    text: list = field(default_factory=list)
    awaiting_resume: bool = False       # restored by a pool restart: silent until its client resumes
    restored_from: int | None = None    # tokens it was restored with, until the first new one


class FrontendHost(Protocol):
    """What the frontend needs of the sidecar around it."""

    def send_client(self, client_key: bytes, msg) -> None: ...
    def wake_executor(self) -> None: ...
    def status(self) -> dict: ...


class RestoredStreams(Protocol):
    """The streams a pool restart brought back (kvhold.sidecar.restore.Restore)."""

    def on_first_token(self) -> None: ...
    def park(self, st: Stream, ids: list[int], done: m.Done) -> None: ...
    def tick(self, now: int) -> None: ...


class Frontend:
    def __init__(self, tables, spec, model_dir, *, runs_model: bool, durable, fingerprint: str,
                 timeline: RecoveryTimeline, host: FrontendHost):
        self.tables = tables
        self.journal = Journal(tables)
        self.spec = spec
        self.runs_model = runs_model        # the engine workload: executors serve requests
        self.durable = durable              # kvhold.sidecar.durable_journal.DurableJournal
        self.fingerprint = fingerprint
        self.timeline = timeline
        self.host = host
        self.restored: RestoredStreams | None = None
        self.tokenizer = self._load_tokenizer(model_dir)
        self.streams: dict[int, Stream] = {}
        self._next_pump_ns = 0
        self.num_admitted = 0
        self.num_finished = collections.Counter()
        self.closed: dict[str, str] = {}    # why admissions are closed, by who closed them
        self._handlers: dict[type, Callable] = {m.Generate: self.on_generate, m.Cancel: self.on_cancel,
                                                m.Status: self.on_status, m.Ping: self.on_ping}
        self.records: dict[int, dict] = {}   # request id -> its durable journal record (admission)

    def add_handler(self, msg_type: type, handler: Callable) -> None:
        """Route client messages of `msg_type` to `handler(client_key, msg)`."""
        self._handlers[msg_type] = handler

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

    def on_generate(self, identity: bytes, msg: m.Generate):
        if self.closed:
            return m.Error(code=ErrorCode.SHUTTING_DOWN, tag=msg.tag,
                           message="not admitting new requests: " + "; ".join(self.closed.values()))
        if not self.runs_model:
            return m.Error(code=ErrorCode.INVALID_PARAMS, tag=msg.tag,
                           message="this sidecar runs no model (workload is not 'engine')")
        # every field's type and range (kvhold.protocol.sampling) before anything is written
        req = RequestInput.check(msg.prompt, msg.prompt_ids, msg.prefix_generated, msg.params,
                                 vocab_size=self.spec.vocab_size)
        params, prefix = req.sampling, req.prefix
        prompt_ids = self._prompt_ids(req)
        self._check_fits(prompt_ids, params)
        slot = self.journal.free_slot()
        if slot is None:
            return m.Error(code=ErrorCode.OVERLOADED, tag=msg.tag,
                           message=f"all {self.tables.geometry.num_slots} request slots are in use")
        request_id = self.journal.new_request_id()
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        error = self._write_durable(msg.tag, request_id, identity, prompt_ids, prefix, params, seed)
        if error is not None:
            return error
        try:
            self.journal.admit(slot, request_id, prompt_ids, max_tokens=params.max_tokens, seed=seed,
                               temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                               stop_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                               prefix_ids=prefix)
        except Exception:               # not admitted: no record may bring it back at a restart
            self.durable.remove(request_id)
            self.records.pop(request_id, None)
            raise
        self._open_stream(request_id, slot, identity, prompt_ids, prefix)
        self.num_admitted += 1
        self._wake_executor()
        return m.Accepted(tag=msg.tag, request_id=request_id, prompt_tokens=len(prompt_ids))

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The request fits the context and its stop ids the vocabulary."""
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

    def _open_stream(self, request_id: int, slot: int, identity: bytes, prompt_ids, prefix) -> None:
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer else None
        for token in prefix if detok else ():   # the state of the uninterrupted run: a character
            detok.push(token)                    # the prefix left unfinished completes here
        self.streams[request_id] = Stream(request_id=request_id, slot=slot, identity=identity,
                                          prompt_len=len(prompt_ids), detok=detok,
                                          last_send_ns=now_ns(), sent=len(prefix), prefix=len(prefix))

    def _prompt_ids(self, req: RequestInput) -> list[int]:
        if req.prompt is None:
            return req.prompt_ids           # checked against the vocabulary by RequestInput
        if self.tokenizer is None:
            raise InvalidParams("this model has no tokenizer.json: send prompt_ids")
        ids = self.tokenizer.encode(req.prompt).ids
        if not ids:
            raise InvalidParams("the prompt is empty")
        return list(ids)

    def _write_durable(self, tag, request_id, identity, prompt_ids, prefix, params, seed):
        """Record the request on disk before it is admitted (kvhold.sidecar.durable_journal); an error
        reply if the disk refuses, so that no accepted request lacks its record."""
        f32 = lambda x: float(np.float32(x))  # what the shm journal stores and the engine samples with
        body = {"request_id": request_id, "generation": int(self.tables.generation),
                "client": identity.hex(), "prompt_ids": list(prompt_ids), "prefix": len(prefix),
                "generated": list(prefix), "max_tokens": params.max_tokens, "seed": seed,
                "temperature": f32(params.temperature), "top_p": f32(params.top_p),
                "top_k": params.top_k, "stop_ids": list(params.stop_token_ids),
                "ignore_eos": params.ignore_eos, "admitted_unix_ns": time.time_ns(),
                "fingerprint": self.fingerprint}
        try:
            self.durable.write(body)
        except OSError as exc:
            log.error("cannot write the durable journal record of a new request: %s", exc)
            return m.Error(code=ErrorCode.OVERLOADED, tag=tag,
                           message=f"cannot journal the request durably ({exc}); retry later")
        self.records[request_id] = dict(body, generated=[])
        return None

    def restore_stream(self, request_id, slot, identity, prompt_len, detok, texts, record) -> None:
        """A request restored by a pool restart (kvhold.sidecar.restore): silent until resumed."""
        prefix = int(record.get("prefix", 0))
        self.streams[request_id] = Stream(
            request_id=request_id, slot=slot, identity=identity, prompt_len=prompt_len, detok=detok,
            sent=prefix + len(texts[prefix:]), prefix=prefix, text=list(texts[prefix:]),
            last_send_ns=now_ns(), awaiting_resume=True, restored_from=len(texts))
        self.records[request_id] = record

    def _send(self, st: Stream, msg) -> None:
        if not st.awaiting_resume:   # a restored stream's client may not be connected yet
            self.host.send_client(st.identity, msg)

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

    # ------------------------------------------------------------------ streaming
    def on_step(self, h, msg: m.StepDone):
        received_ns = now_ns()
        for slot in msg.slots:
            st = self.streams.get(self.journal.request_id_at(slot))
            if st is not None:
                self._pump(st)
        self.timeline.step_done(h.epoch, msg.marks, received_ns)

    def _pump(self, st: Stream) -> None:
        state, count, reason = self.journal.progress(st.slot, st.request_id)
        if st.restored_from is not None and count > st.restored_from:
            st.restored_from = None
            self.restored.on_first_token()
        if count > st.sent:
            ids = self.journal.generated(st.slot, st.sent, count)
            texts = [st.detok.push(t) for t in ids] if st.detok else [""] * len(ids)
            st.text.extend(texts)
            self._send(st, m.Tokens(request_id=st.request_id, start=st.sent - st.prefix, ids=ids,
                                    texts=texts))
            st.sent = count
            st.last_send_ns = now_ns()
        if state == ExecState.FINISHED:
            if st.detok:
                st.text.append(st.detok.flush())
            preempted, recomputed = self.journal.recompute_counts(st.slot)
            done = m.Done(
                request_id=st.request_id, finish_reason=reason.name.lower(),
                prompt_tokens=st.prompt_len, completion_tokens=count - st.prefix, text="".join(st.text),
                preemptions=preempted, recomputed_tokens=recomputed)
            self._send(st, done)
            if st.awaiting_resume:
                self.restored.park(st, self.journal.generated(st.slot, st.prefix, count), done)
            self.journal.release(st.slot)
            self.durable.remove(st.request_id)
            self.records.pop(st.request_id, None)
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
                if not st.awaiting_resume:
                    idle[st.identity].append(st.request_id)
                st.last_send_ns = now
        for identity, ids in idle.items():
            self.host.send_client(identity, m.Keepalive(request_ids=ids))
        self.restored.tick(now)

    def next_deadline_ns(self) -> int:
        deadline = self._next_pump_ns if self.streams else now_ns() + 1_000_000_000
        if self.streams:
            deadline = min(deadline, min(st.last_send_ns for st in self.streams.values()) + KEEPALIVE_NS)
        return deadline

    def status(self) -> dict:
        return {"requests": {"in_flight": len(self.streams), "admitted_total": self.num_admitted,
                             "finished": dict(self.num_finished)},
                "recoveries": self.timeline.records(),
                "admissions": {"open": not self.closed, "closed_by": dict(self.closed)}}

