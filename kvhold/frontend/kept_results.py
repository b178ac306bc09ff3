"""Results kept for pickup, on disk beside the durable journal: they outlive the frontend.

A request whose stream is held for its client (its HTTP server died, its SDK client is away)
and that ends meanwhile has its result kept for a later `Resume` (kvhold.frontend.restore,
`Unclaimed`). Its durable record goes as it ends and its journal slot is released, so the
result itself is the only copy: kept in the frontend's memory alone, a SIGKILL of the
frontend (or of a sidecar that runs it in process) lost it, and the client that came back got
"unknown request". Each kept result is therefore also a file, `results/<request id>.kept`
under the durable journal's directory (msgpack: the client key, the token ids and texts, the
Done message, the log-probs, when it ended), written (to a temporary name, then renamed) before
the request's durable record is removed, and unlinked when the result is picked up, expires or
is dropped. A starting frontend loads them, each checked field by field (`KeptRecord`: token ids
in the vocabulary, a text per id, the Done message's types and counts); a damaged one is set
aside as `<name>.bad` (kvhold.protocol.state_files). A kill of the process loses none (the page cache
keeps the file); no fsync is made, so a machine crash may lose a result, as it loses the client
connections that would claim it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import msgpack

from kvhold.protocol import messages as m
from kvhold.protocol import wire
from kvhold.protocol.errors import KvholdError
from kvhold.protocol.sampling import check_token_ids
from kvhold.protocol.state_files import StateFileError, integer, set_aside

log = logging.getLogger(__name__)
SUFFIX = ".kept"


def _plain(value):
    tolist = getattr(value, "tolist", None)      # numpy arrays and scalars from the tables
    if tolist is not None:
        return tolist()
    raise TypeError(f"cannot keep a {type(value).__name__}")


class KeptResults:
    def __init__(self, directory: Path):
        self.dir = Path(directory)

    def path_for(self, request_id: int) -> Path:
        return self.dir / f"{request_id:016x}{SUFFIX}"

    def save(self, request_id: int, kept) -> None:
        """`kept`: a restore.Unclaimed. A failure is logged: the result stays in memory."""
        doc = {"request_id": request_id, "identity": kept.identity, "ids": list(kept.ids),
               "texts": list(kept.texts), "done": dataclasses.asdict(kept.done),
               "finished_ns": kept.finished_ns, "logprobs": kept.logprobs}
        path = self.path_for(request_id)
        tmp = path.with_suffix(".tmp")
        try:
            self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            data = msgpack.packb(doc, default=_plain, use_bin_type=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            log.error("the result of request %#x is kept in memory only (a restart of this process "
                      "loses it): %s", request_id, exc)

    def remove(self, request_id: int) -> None:
        try:
            self.path_for(request_id).unlink(missing_ok=True)
        except OSError as exc:
            log.warning("could not remove the kept result of request %#x: %s", request_id, exc)

    def load(self, vocab_size: int | None = None) -> list["KeptRecord"]:
        """Every kept result, oldest first; a damaged file (KeptRecord) is set aside as
        `<name>.bad` with a log line (kvhold.protocol.state_files)."""
        if not self.dir.is_dir():
            return []
        out = []
        for path in self.dir.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)          # a write cut short: its result was in memory
                continue
            if path.suffix != SUFFIX:
                continue
            try:
                record = KeptRecord.from_bytes(path.read_bytes(), vocab_size)
                if path.name != self.path_for(record.request_id).name:
                    raise StateFileError(f"holds request {record.request_id:#x}, not the one of its name")
                out.append(record)
            except (OSError, StateFileError) as exc:
                set_aside(path, str(exc), "the kept result")
        return sorted(out, key=lambda r: r.finished_ns)


# the log-prob fields a kept result may hold (kvhold.frontend.logprob_stream.fields), and which
# of them have one entry per generated token
LOGPROB_FIELDS = ("logprobs", "top_ids", "top_logprobs", "prompt_ids", "prompt_logprobs",
                  "prompt_top_ids", "prompt_top_logprobs", "ranks", "prompt_ranks")
PER_TOKEN = ("logprobs", "top_ids", "top_logprobs", "ranks")


@dataclasses.dataclass(frozen=True, slots=True)
class KeptRecord:
    """A kept result as read back, every field checked: what `KeptResults.save` writes."""
    request_id: int
    identity: bytes
    ids: list[int]
    texts: list[str]
    done: m.Done
    finished_ns: int
    logprobs: dict

    @classmethod
    def from_bytes(cls, data: bytes, vocab_size: int | None = None) -> "KeptRecord":
        """StateFileError with the reason when `data` is not a kept result (ids past
        `vocab_size`, when given, included)."""
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except (ValueError, msgpack.UnpackException) as exc:
            raise StateFileError(f"not msgpack ({type(exc).__name__})") from None
        if not isinstance(doc, dict):
            raise StateFileError("not a map")
        unknown = set(doc) - {"request_id", "identity", "ids", "texts", "done", "finished_ns", "logprobs"}
        if unknown:
            raise StateFileError(f"unknown field {sorted(map(str, unknown))[0][:40]!r}")
        rid = integer(doc.get("request_id"), "request_id", 1, (1 << 64) - 1)
        identity = doc.get("identity")
        if not isinstance(identity, bytes) or not identity:
            raise StateFileError("identity is not a client key")
        try:
            ids = check_token_ids(doc.get("ids"), "ids", vocab_size)
        except KvholdError as exc:
            raise StateFileError(str(exc)) from None
        texts = doc.get("texts")
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise StateFileError("texts is not a list of strings")
        if len(texts) != len(ids):
            raise StateFileError(f"{len(texts)} texts for {len(ids)} token ids")
        try:
            done = wire.checked(m.Done, doc.get("done"))
        except (TypeError, ValueError) as exc:
            raise StateFileError(f"done: {exc}") from None
        if done.request_id != rid:
            raise StateFileError(f"done names request {done.request_id:#x}")
        if done.completion_tokens != len(ids) or done.prompt_tokens < 0:
            raise StateFileError(f"done counts {done.completion_tokens} tokens, the result has {len(ids)}")
        finished = integer(doc.get("finished_ns", 0), "finished_ns", 0, (1 << 63) - 1)
        logprobs = doc.get("logprobs") or {}
        if not isinstance(logprobs, dict) or not set(logprobs) <= set(LOGPROB_FIELDS):
            raise StateFileError("logprobs is not a map of log-prob fields")
        try:
            wire.checked(m.Tokens, {"request_id": rid, "start": 0, "ids": ids, "texts": texts, **logprobs})
        except (TypeError, ValueError) as exc:
            raise StateFileError(f"logprobs: {exc}") from None
        for key in PER_TOKEN:
            if key in logprobs and len(logprobs[key]) != len(ids):
                raise StateFileError(f"{len(logprobs[key])} {key} for {len(ids)} token ids")
        return cls(rid, identity, ids, texts, done, finished, logprobs)
