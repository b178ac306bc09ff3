"""The durable request journal: every admitted request on local disk, for pool restarts.

The shared-memory journal (kvhold.protocol.journal) dies with the pool; this one survives the
sidecar, a pool restart and a reboot. One file per request, `req-<id hex>.json`, in
the journal directory (`--journal-dir`; default `STATE/journal/<instance>`, STATE being
$KVHOLD_STATE_DIR, systemd's $STATE_DIRECTORY, /var/lib/kvhold for root, or
`${XDG_STATE_HOME:-~/.local/state}/kvhold`: never /run or /tmp, which a reboot empties). Written:
* at admission: prompt ids, sampling params (the seed the sidecar picked included),
  the owning client's key (transport byte + ZeroMQ routing id), model fingerprint;
* at drain (pool restart, SIGTERM): the same plus the tokens committed so far;
* removed once the request's end was sent to its client.
A record is versioned JSON, `{"format", "version", "crc32", "body"}`, with a CRC32 of
the canonical JSON of `body`; it is written to a temporary file, fsynced, renamed
into place, and the directory fsynced, so a crash leaves the old or the new record,
never a torn one. A record that fails to parse, to match its checksum or its
version, or holds a field of the wrong type or range (checked as a new request's are,
kvhold.protocol.sampling), is never silently dropped and never stops a start: `load()`
reports it failed with the reason and moves it to `failed/` (kept for the operator),
together with a `.reason` file.
A lost unlink (power cut right after a request ended) brings the finished request
back once more; it then runs again to the same output and is kept for pickup.
"""
from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from kvhold.protocol.sampling import SamplingParams, check_token_ids, show

log = logging.getLogger(__name__)
FORMAT = "kvhold-journal"
VERSION = 1
PREFIX, SUFFIX = "req-", ".json"
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
    for key in ("request_id", "generation", "seed", "max_tokens", "top_k"):
        if isinstance(body.get(key), bool) or not isinstance(body.get(key), int):
            raise ValueError(f"field {key!r} missing or not an integer")
    if not 0 < body["request_id"] < 2**64:
        raise ValueError(f"request_id {show(body['request_id'])} is not in [1, 2**64)")
    if not 0 <= body["generation"] < 2**64:
        raise ValueError(f"generation {show(body['generation'])} is not in [0, 2**64)")
    for key in ("temperature", "top_p"):
        if key not in body:
            raise ValueError(f"field {key!r} missing")
    sampling = SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                              top_p=body["top_p"], top_k=body["top_k"], seed=body["seed"],
                              stop_token_ids=_list(body, "stop_ids"),
                              ignore_eos=body.get("ignore_eos", False))
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


def _list(body: dict, key: str) -> list:
    v = body.get(key)
    if not isinstance(v, list):
        raise ValueError(f"field {key!r} missing or not a list of token ids")
    return v


class DurableJournal:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.failed_dir = self.dir / "failed"

    def path_for(self, request_id: int) -> Path:
        return self.dir / f"{PREFIX}{request_id:016x}{SUFFIX}"

    # ------------------------------------------------------------------ writing
    def write(self, body: dict) -> None:
        """Atomically replace the request's record (fsync file, rename, fsync directory)."""
        path = self.path_for(int(body["request_id"]))
        self._write_file(path, encode_record(body))

    def _write_file(self, path: Path, data: bytes) -> None:
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        self._fsync_dir()

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, request_id: int) -> None:
        self.path_for(request_id).unlink(missing_ok=True)

    # ------------------------------------------------------------------ generation
    @property
    def last_generation(self) -> int:
        try:
            return int((self.dir / "generation").read_text().strip())
        except (FileNotFoundError, ValueError):
            return 0

    def set_generation(self, generation: int) -> None:
        self._write_file(self.dir / "generation", f"{generation}\n".encode())

    def write_json(self, name: str, doc: dict) -> None:
        self._write_file(self.dir / name, (json.dumps(doc) + "\n").encode())

    def read_json(self, name: str) -> dict | None:
        try:
            doc = json.loads((self.dir / name).read_text())
        except (OSError, ValueError, RecursionError):
            return None
        return doc if isinstance(doc, dict) else None

    # ------------------------------------------------------------------ reading
    def load(self) -> tuple[list[dict], list[FailedRecord]]:
        """Every record in the directory, sorted by request id; damaged ones failed and moved."""
        good, failed = [], []
        for tmp in self.dir.glob(f"{PREFIX}*.tmp"):
            tmp.unlink(missing_ok=True)      # a write that never reached its rename
        for path in sorted(self.dir.glob(f"{PREFIX}*{SUFFIX}")):
            rid = _id_from_name(path.name)
            try:
                body = decode_record(path.read_bytes())
                if rid is not None and body["request_id"] != rid:
                    raise ValueError(f"names request {body['request_id']:#x}, file says {rid:#x}")
                good.append(body)
            except Exception as exc:     # noqa: BLE001 - one record must never stop a start
                reason = str(exc) if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {exc}"
                failed.append(self.fail(path, rid or 0, reason))
        return good, failed

    def fail(self, path: Path, request_id: int, reason: str) -> FailedRecord:
        """Move a record that cannot be restored to failed/, with its reason next to it."""
        self.failed_dir.mkdir(mode=0o700, exist_ok=True)
        dest = self.failed_dir / path.name
        try:
            os.replace(path, dest)
            dest.with_suffix(".reason").write_text(reason + "\n")
        except OSError as exc:
            log.error("could not move %s to %s: %s", path, dest, exc)
            dest = path
        log.error("journal record for request %#x cannot be restored: %s (kept as %s)",
                  request_id, reason, dest)
        return FailedRecord(request_id=request_id, path=str(dest), reason=reason)


def _id_from_name(name: str) -> int | None:
    try:
        return int(name[len(PREFIX):-len(SUFFIX)], 16)
    except ValueError:
        return None
