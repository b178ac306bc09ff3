"""The durable request journal: every admitted request on local disk, for pool restarts.

The shared-memory journal (kvhold.protocol.journal) dies with the pool; this one survives the
sidecar, a pool restart and a reboot. It lives in the journal directory (`--journal-dir`;
default `STATE/journal/<instance>`, STATE being $KVHOLD_STATE_DIR, systemd's
$STATE_DIRECTORY, /var/lib/kvhold for root, or `${XDG_STATE_HOME:-~/.local/state}/kvhold`:
never /run or /tmp, which a reboot empties). A record holds a request's prompt ids,
sampling params as one map (`sampling`: kvhold.protocol.sampling.SamplingParams as
journaled, the seed the sidecar picked included), the owning client's key (transport byte +
ZeroMQ routing id), the model fingerprint, and, once drained, the tokens committed so far.
Records of earlier builds hold the params as fields of the body (`max_tokens`, `seed`,
`temperature`, `top_p`, `top_k`, `stop_ids`, `ignore_eos`, `logprobs`, `prompt_logprobs`):
`record_sampling` reads either form, so a pool restart across an upgrade restores them. A record is versioned JSON on one line, `{"format", "version", "crc32", "body"}`,
with a CRC32 of the canonical JSON of `body`. Two kinds of file hold records:
* **admission segments**, `seg-<seq hex>.jsonl`: the records of one *group commit*, one per
  line. Admissions are made durable in batches by `GroupCommit`, a thread of its own: it
  takes every record queued since its last batch, writes them to a temporary file, fsyncs
  it, renames it into place and fsyncs the directory: two fsyncs per batch, however many
  admissions it holds, and none on the sidecar's event loop. The frontend acknowledges
  an admission (and makes it runnable) only once its batch is durable. A request's end is
  recorded by appending its id to the segment's `seg-<seq hex>.ended` (not fsynced, like
  the unlink it replaces); a segment whose requests have all ended is removed with it.
  These file operations run on the group commit's thread too, so a request's end costs the
  loop no system call;
* **request files**, `req-<id hex>.json`: one record each, written atomically the same
  way (temporary file, fsync, rename, directory fsync) by `write`, at drain (pool restart,
  SIGTERM) with the tokens committed so far. A request file supersedes the request's
  admission record; format version 1 sidecars wrote every record this way, and
  such files are read the same.
A crash leaves every file either absent, or old, or new, never torn. A temporary file
(a batch or record whose rename never happened, or whose write failed: it is removed
then, and any left over at the next start) was never acknowledged. A record that fails to
parse, to match its checksum or its version, or holds a field of the wrong type or
range (checked as a new request's are, kvhold.protocol.sampling), is never silently
dropped and never stops a start: `load()` reports it
failed with the reason and moves it to `failed/` (kept for the operator), together with a
`.reason` file (a damaged line of a segment is moved alone, as `seg-<seq>-<line>.bad`).
A lost `.ended` line or unlink (power cut right after a request ended) brings the finished
request back once more; it then runs again to the same output and is kept for pickup.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvhold.protocol.sampling import SamplingParams, check_token_ids, show
from kvhold.protocol.state_files import StateFileError, read_generation, set_aside

log = logging.getLogger(__name__)
FORMAT = "kvhold-journal"
VERSION = 1
PREFIX, SUFFIX = "req-", ".json"
SEGMENT_PREFIX, SEGMENT_SUFFIX, ENDED_SUFFIX = "seg-", ".jsonl", ".ended"
MAX_RECORD_BYTES = 64 << 20


def default_journal_root() -> Path:
    """STATE/journal, STATE being $KVHOLD_STATE_DIR, else systemd's $STATE_DIRECTORY (a unit
    with StateDirectory=), else /var/lib/kvhold for root, else $XDG_STATE_HOME/kvhold."""
    state = os.environ.get("KVHOLD_STATE_DIR") or os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if not state:
        xdg = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        state = "/var/lib/kvhold" if os.getuid() == 0 else os.path.join(xdg, "kvhold")
    return Path(state) / "journal"


@dataclass(frozen=True, slots=True)
class FailedRecord:
    request_id: int           # from the file name: known even when the content is not
    path: str
    reason: str

    def to_dict(self) -> dict:
        return {"request_id": self.request_id, "path": self.path, "reason": self.reason}


def encode_record(body: dict) -> bytes:
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    crc = zlib.crc32(canonical.encode())
    return json.dumps({"format": FORMAT, "version": VERSION, "crc32": crc, "body": body},
                      sort_keys=True).encode() + b"\n"


def decode_record(data: bytes) -> dict:
    """The record's body; ValueError with the reason if anything is wrong."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:    # JSONDecodeError, UnicodeDecodeError, huge ints
        raise ValueError(f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} record")
    if doc.get("version") != VERSION:
        raise ValueError(f"record version {doc.get('version')!r}, this sidecar reads {VERSION}")
    body = doc.get("body")
    if not isinstance(body, dict):
        raise ValueError("record has no body")
    try:
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValueError(f"record body cannot be checksummed ({type(exc).__name__})") from None
    if zlib.crc32(canonical.encode()) != doc.get("crc32"):
        raise ValueError("checksum mismatch (the record was damaged on disk)")
    _check_body(body)
    return body


def _check_body(body: dict) -> None:
    """Every field of a record has its type and range: the request's own fields by the same
    definitions as a new request's admission (kvhold.protocol.sampling), so that a record read
    back can always be admitted again. InvalidParams/ValueError with the reason otherwise."""
    for key in ("request_id", "generation"):
        if isinstance(body.get(key), bool) or not isinstance(body.get(key), int):
            raise ValueError(f"field {key!r} missing or not an integer")
    if not 0 < body["request_id"] < 2**64:
        raise ValueError(f"request_id {show(body['request_id'])} is not in [1, 2**64)")
    if not 0 <= body["generation"] < 2**64:
        raise ValueError(f"generation {show(body['generation'])} is not in [0, 2**64)")
    sampling = record_sampling(body)
    prompt = check_token_ids(_list(body, "prompt_ids"), "prompt_ids")
    generated = check_token_ids(_list(body, "generated"), "generated", label="generated token id")
    if not prompt:
        raise ValueError("empty prompt")
    if len(generated) > sampling.max_tokens:
        raise ValueError(f"{len(generated)} generated tokens exceed max_tokens ({sampling.max_tokens})")
    prefix = body.get("prefix", 0)
    if isinstance(prefix, bool) or not isinstance(prefix, int) or not 0 <= prefix <= len(generated):
        raise ValueError(f"field 'prefix' ({show(prefix)}) is not a count of the generated tokens")
    client = body.get("client")
    if not isinstance(client, str):
        raise ValueError("field 'client' missing")
    try:
        if not bytes.fromhex(client):
            raise ValueError
    except ValueError:
        raise ValueError(f"field 'client' ({show(client)}) is not a client key in hex") from None
    if not isinstance(body.get("fingerprint", ""), str):
        raise ValueError("field 'fingerprint' is not a string")
    for key in ("cancelled",):
        if not isinstance(body.get(key, False), bool):
            raise ValueError(f"field {key!r} is not true or false")


def record_sampling(body: dict) -> SamplingParams:
    """A record's sampling params, with their seed: its `sampling` map, or the fields of the
    body in a record of an earlier build (module docstring). InvalidParams/ValueError naming
    the field that does not fit."""
    if "sampling" in body:
        sampling = SamplingParams.from_dict(body["sampling"])
        if sampling.seed is None:
            raise ValueError("field 'sampling.seed' missing")
        return sampling
    for key in ("seed", "max_tokens", "top_k"):
        if isinstance(body.get(key), bool) or not isinstance(body.get(key), int):
            raise ValueError(f"field {key!r} missing or not an integer")
    for key in ("temperature", "top_p"):
        if key not in body:
            raise ValueError(f"field {key!r} missing")
    return SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                          top_p=body["top_p"], top_k=body["top_k"], seed=body["seed"],
                          stop_token_ids=_list(body, "stop_ids"), ignore_eos=body.get("ignore_eos", False),
                          logprobs=body.get("logprobs"), prompt_logprobs=body.get("prompt_logprobs"))


def _list(body: dict, key: str) -> list:
    v = body.get(key)
    if not isinstance(v, list):
        raise ValueError(f"field {key!r} missing or not a list of token ids")
    return v


class DurableJournal:
    """The journal directory. Segments and request files are written by one thread at a time
    (`GroupCommit`'s for segments; the loop, or close() once it stopped, for the rest); the
    bookkeeping of which segment holds which live request (`committed`, `remove`) is the
    loop's alone."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.failed_dir = self.dir / "failed"
        self._next_seq = 1 + max((s for s in map(_seq_from_name, os.listdir(self.dir)) if s is not None),
                                 default=0)
        self._segment_of: dict[int, str] = {}     # live request id -> the segment with its admission
        self._live: dict[str, set[int]] = {}      # segment name -> its requests not ended yet
        self._loaded_lines: dict[int, bytes] = {}  # restored from a segment, until restore is done
        self._files: set[int] = set()               # request ids with a request file
        self.batches = self.batched_records = 0
        self.defer: Callable[[Callable[[], None]], None] | None = None   # GroupCommit: file ops off the loop

    def path_for(self, request_id: int) -> Path:
        return self.dir / f"{PREFIX}{request_id:016x}{SUFFIX}"

    # ------------------------------------------------------------------ writing
    def write(self, body: dict) -> None:
        """Atomically replace the request's record file (fsync file, rename, fsync directory)."""
        path = self.path_for(int(body["request_id"]))
        self._write_file(path, encode_record(body))
        self._files.add(int(body["request_id"]))

    def write_batch(self, bodies: list[dict]) -> str:
        """One admission segment holding `bodies`, durable on return; its name. The records
        count as live once the loop calls `committed` with it."""
        name = f"{SEGMENT_PREFIX}{self._next_seq:016x}{SEGMENT_SUFFIX}"
        self._next_seq += 1
        self._write_file(self.dir / name, b"".join(encode_record(b) for b in bodies))
        self.batches += 1
        self.batched_records += len(bodies)
        return name

    def committed(self, name: str, request_ids) -> None:
        """The loop learns that segment `name` (from `write_batch`) holds these requests."""
        self._live[name] = set(request_ids)
        for rid in request_ids:
            self._segment_of[rid] = name

    def _write_file(self, path: Path, data: bytes) -> None:
        tmp = path.with_suffix(".tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)     # a refused write leaves nothing behind
            raise
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, request_id: int) -> None:
        """The request ended: its records go (a request file is unlinked, an admission record
        marked ended in its segment, the segment removed once none of its requests is live).
        The bookkeeping is done here; the file operations by `defer` when it is set (the group
        commit's thread, in order after the segment's own write), else at once."""
        if request_id in self._files:
            self._files.discard(request_id)
            self._run(lambda: self.path_for(request_id).unlink(missing_ok=True))
        name = self._segment_of.pop(request_id, None)
        if name is None:
            return
        live = self._live.get(name, set())
        live.discard(request_id)
        if live:
            self._run(lambda: self._mark_ended(name, request_id))
            return
        self._live.pop(name, None)
        self._run(lambda: self._unlink_segment(name))

    def _run(self, op: Callable[[], None]) -> None:
        if self.defer is not None:
            self.defer(op)
        else:
            op()

    def _mark_ended(self, name: str, request_id: int) -> None:
        try:
            fd = os.open(self.dir / (name[:-len(SEGMENT_SUFFIX)] + ENDED_SUFFIX),
                         os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, f"{request_id:016x}\n".encode())
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("could not mark request %#x ended in %s: %s (a crash now would run it "
                      "again)", request_id, name, exc)

    def _unlink_segment(self, name: str) -> None:
        (self.dir / name).unlink(missing_ok=True)
        (self.dir / (name[:-len(SEGMENT_SUFFIX)] + ENDED_SUFFIX)).unlink(missing_ok=True)

    def stats(self) -> dict:
        return {"segments": len(self._live), "batches": self.batches, "batched_records": self.batched_records}

    # ------------------------------------------------------------------ generation
    @property
    def last_generation(self) -> int:
        return read_generation(self.dir / "generation")

    def set_generation(self, generation: int) -> None:
        self._write_file(self.dir / "generation", f"{generation}\n".encode())

    def write_json(self, name: str, doc: dict) -> None:
        self._write_file(self.dir / name, (json.dumps(doc) + "\n").encode())

    def read_json(self, name: str, check: Callable[[dict], None] = lambda doc: None) -> dict | None:
        """The map in file `name`, None if there is none; one that is not JSON, not a map or
        refused by `check` (StateFileError) is set aside (kvhold.protocol.state_files)."""
        path = self.dir / name
        try:
            doc = json.loads(path.read_bytes())
            if not isinstance(doc, dict):
                raise StateFileError(f"not a map ({type(doc).__name__})")
            check(doc)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as exc:     # StateFileError is a ValueError
            set_aside(path, str(exc) if isinstance(exc, StateFileError) else type(exc).__name__, "the file")
            return None
        return doc

    # ------------------------------------------------------------------ reading
    def load(self) -> tuple[list[dict], list[FailedRecord]]:
        """Every live record in the directory, sorted by request id (a request file over the
        request's admission record); damaged ones failed and moved."""
        for pattern in (f"{PREFIX}*.tmp", f"{SEGMENT_PREFIX}*.tmp"):
            for tmp in self.dir.glob(pattern):
                tmp.unlink(missing_ok=True)      # a write that never reached its rename
        failed: list[FailedRecord] = []
        from_segments = self._load_segments(failed)
        good: dict[int, dict] = {rid: body for rid, (body, _) in from_segments.items()}
        for path in sorted(self.dir.glob(f"{PREFIX}*{SUFFIX}")):
            rid = _id_from_name(path.name)
            try:
                body = decode_record(path.read_bytes())
                if rid is not None and body["request_id"] != rid:
                    raise ValueError(f"names request {body['request_id']:#x}, file says {rid:#x}")
                good[body["request_id"]] = body
                self._files.add(body["request_id"])
                from_segments.pop(body["request_id"], None)     # the request file is newer
            except Exception as exc:     # noqa: BLE001 - one record must never stop a start
                reason = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
                from_segments.pop(rid, None)
                good.pop(rid, None)
                failed.append(self.fail(path, rid or 0, reason))   # its admission record too
        self._loaded_lines = {rid: line for rid, (_, line) in from_segments.items()}
        return [good[rid] for rid in sorted(good)], failed

    def _load_segments(self, failed: list[FailedRecord]) -> dict[int, tuple[dict, bytes]]:
        records: dict[int, tuple[dict, bytes]] = {}
        ended: set[int] = set()
        names = sorted(n for n in os.listdir(self.dir) if _seq_from_name(n) is not None)
        segments = [n for n in names if n.endswith(SEGMENT_SUFFIX)]
        for name in names:
            if name.endswith(ENDED_SUFFIX):
                if name[:-len(ENDED_SUFFIX)] + SEGMENT_SUFFIX not in segments:
                    (self.dir / name).unlink(missing_ok=True)   # its segment is gone
                    continue
                for line in (self.dir / name).read_bytes().split(b"\n"):
                    try:
                        ended.add(int(line, 16))
                    except ValueError:
                        pass   # a torn last line: that request comes back once more
        for name in segments:
            self._live[name] = set()
            try:
                lines = (self.dir / name).read_bytes().split(b"\n")
            except OSError as exc:
                failed.append(self._fail_line(name, 0, b"", f"unreadable segment ({exc})"))
                continue
            for index, line in enumerate(lines):
                if not line.strip():
                    continue
                try:
                    body = decode_record(line)
                except Exception as exc:     # noqa: BLE001 - one record must never stop a start
                    reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                    failed.append(self._fail_line(name, index, line, reason))
                    continue
                rid = body["request_id"]
                if rid in ended:
                    continue
                if rid in self._segment_of:        # a newer record of the same request
                    self._live[self._segment_of[rid]].discard(rid)
                records[rid] = (body, line)
                self._segment_of[rid] = name
                self._live[name].add(rid)
        for name in segments:
            if not self._live[name]:
                del self._live[name]
                self._unlink_segment(name)
        return records

    def _fail_line(self, name: str, index: int, line: bytes, reason: str) -> FailedRecord:
        self.failed_dir.mkdir(mode=0o700, exist_ok=True)
        dest = self.failed_dir / f"{name[:-len(SEGMENT_SUFFIX)]}-{index}.bad"
        try:
            dest.write_bytes(line)
            dest.with_suffix(".reason").write_text(reason + "\n")
        except OSError as exc:
            log.error("could not keep a damaged line of %s in %s: %s", name, dest, exc)
        try:
            rid = int(json.loads(line)["body"]["request_id"])
        except Exception:
            rid = 0
        log.error("journal record %d of %s (request %#x) cannot be restored: %s (kept as %s)",
                  index, name, rid, reason, dest)
        return FailedRecord(request_id=rid, path=str(dest), reason=reason)

    def restored(self) -> None:
        """Restore is done with the records `load` returned."""
        self._loaded_lines.clear()

    def fail(self, path: Path, request_id: int, reason: str) -> FailedRecord:
        """Move a record that cannot be restored to failed/, with its reason next to it. A record
        that is a line of a segment is copied there alone and marked ended in its segment."""
        self.failed_dir.mkdir(mode=0o700, exist_ok=True)
        dest = self.failed_dir / path.name
        line = self._loaded_lines.pop(request_id, None)
        try:
            if line is not None:
                dest.write_bytes(line)
            else:
                os.replace(path, dest)
                self._files.discard(request_id)
            dest.with_suffix(".reason").write_text(reason + "\n")
            if request_id in self._segment_of:        # its admission record is not restored either
                self.remove(request_id)
        except OSError as exc:
            log.error("could not move %s to %s: %s", path, dest, exc)
            dest = path
        log.error("journal record for request %#x cannot be restored: %s (kept as %s)",
                  request_id, reason, dest)
        return FailedRecord(request_id=request_id, path=str(dest), reason=reason)


class GroupCommit:
    """Admissions made durable in batches, off the event loop.

    `submit` queues a record (any thread; the loop). A thread takes everything queued since
    its last batch, writes it as one segment (`DurableJournal.write_batch`: two fsyncs per
    batch) and calls `on_done(name, request_ids, error)` from that thread: `name` is None and
    `error` the OSError when the disk refused the batch, which then left no file behind.
    The same thread runs the journal's other file operations (`DurableJournal.defer`: ended
    marks, unlinks), after the batch it took with them, so the loop makes no system call for
    a request's end either.
    `close` lets the batch being written finish, runs the file operations queued, and
    returns the records never written."""

    def __init__(self, journal: DurableJournal, on_done: Callable[[str | None, list[int], OSError | None], None]):
        self.journal = journal
        self.on_done = on_done
        self._queue: list[dict] = []
        self._ops: list[Callable[[], None]] = []
        self._cond = threading.Condition()
        self._closing = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="journal-commit", daemon=True)
        self._thread.start()
        journal.defer = self._defer

    def submit(self, body: dict) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("the journal's group commit is closed")
            self._queue.append(body)
            self._cond.notify()

    def _defer(self, op: Callable[[], None]) -> None:
        with self._cond:
            if self._closing:
                op()                     # the thread is gone or going: at once, on the caller's
                return
            self._ops.append(op)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._queue and not self._ops and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                batch, self._queue = self._queue, []
                ops, self._ops = self._ops, []
                self._busy = True
            if batch:
                ids = [int(b["request_id"]) for b in batch]
                try:
                    name, error = self.journal.write_batch(batch), None
                except OSError as exc:
                    name, error = None, exc
                    log.error("cannot write %d admission records durably: %s", len(batch), exc)
                self.on_done(name, ids, error)
            _run_ops(ops)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until everything queued so far is written and done; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closing or not (self._busy or self._queue or self._ops),
                                       timeout_s)

    def close(self, timeout_s: float = 10.0) -> list[dict]:
        with self._cond:
            self._closing = True
            unwritten, self._queue = self._queue, []
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            ops, self._ops = self._ops, []
        _run_ops(ops)                    # queued ended marks and unlinks are not lost
        self.journal.defer = None
        return unwritten


def _run_ops(ops: list[Callable[[], None]]) -> None:
    for op in ops:
        try:
            op()
        except OSError as exc:       # an unlink refused: that request comes back once more
            log.error("journal file operation failed: %s", exc)


def _id_from_name(name: str) -> int | None:
    try:
        return int(name[len(PREFIX):-len(SUFFIX)], 16)
    except ValueError:
        return None


def _seq_from_name(name: str) -> int | None:
    """The sequence number of a segment or its `.ended` file, else None."""
    for suffix in (SEGMENT_SUFFIX, ENDED_SUFFIX):
        if name.startswith(SEGMENT_PREFIX) and name.endswith(suffix):
            try:
                return int(name[len(SEGMENT_PREFIX):-len(suffix)], 16)
            except ValueError:
                return None
    return None
