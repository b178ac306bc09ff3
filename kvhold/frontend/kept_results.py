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
is dropped. A starting frontend loads them. A kill of the process loses none (the page cache
keeps the file); no fsync is made, so a machine crash may lose a result, as it loses the client
connections that would claim it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import msgpack

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

    def load(self) -> list[dict]:
        """Every kept result, oldest first (a damaged file is logged and removed)."""
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
                doc = msgpack.unpackb(path.read_bytes(), raw=False)
                if not (isinstance(doc, dict) and isinstance(doc.get("identity"), bytes)
                        and isinstance(doc.get("done"), dict) and isinstance(doc.get("request_id"), int)):
                    raise ValueError("not a kept result")
                out.append(doc)
            except (OSError, ValueError, msgpack.UnpackException) as exc:
                log.error("dropped the kept result %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
        return sorted(out, key=lambda d: d.get("finished_ns", 0))
