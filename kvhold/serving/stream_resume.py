"""Streams that outlive the HTTP server: stream ids, SSE event ids and the resume route.

Under `kvhold serve` the HTTP server is a process of its own (kvhold.serving.serve): when it
dies, its clients' connections break but the sidecar keeps their requests, held for their
owner (kvhold.frontend.restore). A restarted HTTP server presents the same ZeroMQ routing id
from the same uid, so the sidecar knows it as the same owner, and a client takes its stream
up again:

    GET /v1/streams/{stream_id}           Last-Event-ID: <stream id>-<N>

Every response has a *stream id*, 128 random bits in hex (`new_stream_id`): not the
sidecar's request id, which is sequential and shared by every client of the one HTTP server
(the sidecar knows them all as one owner), so an id cannot be guessed from another. The
response's id is `cmpl-<stream id>` or `chatcmpl-<stream id>`, and every event of a streamed
/v1/completions or /v1/chat/completions response carries an id, `<stream id>-<N>`
(kvhold.serving.generation.EventIds: N counts the request's tokens the text through that event
covers; the end's events continue from there). The route answers `text/event-stream` with the
events after the one named, exactly as the original stream would have sent them (same chunk
objects, ids, finish chunk, usage chunk when asked for, then `data: [DONE]`); without
Last-Event-ID it sends the whole stream from its first event. `stream_id` is the id's hex
part (or the response's id).

A stream belongs to the credential that started it: the `Authorization` header's value (the
API key; without one configured, whatever a client sends, or nothing). Its record keeps a
hash of it (`owner_of`, SHA-256: never the key itself), and a resume with another credential
is answered as a stream that does not exist (404), with nothing done to the stream: its owner
can still take it up.

How: when a streamed response starts, what the sidecar does not know of it (its request id,
owner, endpoint, stop strings, include_usage, created, prompt tokens) is written to a small
file under the instance's runtime directory (`http-streams/`, 0700), removed when the response
ends here; a restarted HTTP server finds it there. The resume route reads it, asks the sidecar
for the request's tokens from the first (`AsyncClient.attach`: a request that ended while no
HTTP server was up comes from its kept result), replays them through the same text and
stop-string logic, and sends only the events after Last-Event-ID. A client that goes away
cancels the request, as on the original stream.

Answers: 400 for a malformed Last-Event-ID or stream id, or a Last-Event-ID of another
stream; 404 when there is nothing to resume (no such stream streamed here, another
credential's, or the sidecar no longer has it: delivered, cancelled (a stream no client
claimed within the sidecar's --unclaimed-cancel-s)); 409 while the stream is still being sent
on another connection; 501 on a server that does not resume streams (`kvhold router`).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from pathlib import Path

from kvhold.serving.openai_schema import ApiError, bad_request

log = logging.getLogger(__name__)
RECORD_KEEP_S = 3600.0          # a record left by a server that died is removed at a start after this
STREAM_ID_BYTES = 16            # 128 random bits
_HEX = f"[0-9a-f]{{{2 * STREAM_ID_BYTES}}}"
_EVENT_ID = re.compile(f"({_HEX})-(0|[1-9][0-9]{{0,9}})")
_STREAM_ID = re.compile(f"(?:chatcmpl-|cmpl-)?({_HEX})")
_OWNER = re.compile("[0-9a-f]{64}")


def new_stream_id() -> str:
    return secrets.token_hex(STREAM_ID_BYTES)


def owner_of(authorization: str | None) -> str:
    """What a stream's record keeps of the credential that started it (the Authorization header's
    bearer token, as the API key is checked; else the header as sent): a hash, not the key."""
    scheme, _, token = (authorization or "").partition(" ")
    credential = "bearer " + token.strip() if scheme.lower() == "bearer" else (authorization or "")
    return hashlib.sha256(b"kvhold stream owner\0" + credential.encode("utf-8", "surrogateescape")).hexdigest()


def parse_stream_id(text: str) -> str:
    """The stream id of the route's path: its hex, or a response id (cmpl-<hex>, chatcmpl-<hex>)."""
    match = _STREAM_ID.fullmatch(text)
    if match is None:
        raise bad_request(f"{text[:80]!r} is not a stream id: want the hex id of an event id "
                          "(<stream id>-<N>) or a response id (cmpl-<hex>, chatcmpl-<hex>)",
                          param="stream_id", code="invalid_stream_id")
    return match.group(1)


def parse_last_event_id(text: str | None, stream_id: str) -> int:
    """The N of a Last-Event-ID `<stream id>-<N>` naming `stream_id`; -1 when there is none."""
    if text is None:
        return -1
    match = _EVENT_ID.fullmatch(text.strip())
    if match is None:
        raise bad_request(f"Last-Event-ID {text[:80]!r} is not an event id of this server: want "
                          "<stream id>-<N>, as in the stream's 'id:' lines",
                          param="Last-Event-ID", code="invalid_last_event_id")
    if match.group(1) != stream_id:
        raise bad_request(f"Last-Event-ID {text.strip()!r} names stream {match.group(1)}, not "
                          f"{stream_id}", param="Last-Event-ID", code="invalid_last_event_id")
    return int(match.group(2))


def not_found(stream_id: str, why: str) -> ApiError:
    return ApiError(404, f"no stream {stream_id} to resume: {why}", type="not_found_error",
                    param="stream_id", code="stream_not_found")


class StreamRecords:
    """What a resume needs of a streamed response and the sidecar does not keep: one small file
    per stream under `directory` (0700, the instance's runtime directory)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._expire()

    def path(self, stream_id: str) -> Path:
        return self.dir / f"{stream_id}.json"

    def write(self, stream_id: str, record: dict) -> None:
        tmp = self.dir / f".{stream_id}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with open(fd, "w") as f:
            f.write(json.dumps(record))
        os.replace(tmp, self.path(stream_id))

    def read(self, stream_id: str, owner: str) -> dict | None:
        """The record of `stream_id` if `owner` (owner_of) started it; None otherwise."""
        try:
            record = json.loads(self.path(stream_id).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("record of stream %s unreadable: %s", stream_id, exc)
            return None
        if not _valid(record):
            log.warning("record of stream %s is not a stream record: ignored", stream_id)
            return None
        return record if hmac.compare_digest(record["owner"], owner) else None

    def remove(self, stream_id: str) -> None:
        self.path(stream_id).unlink(missing_ok=True)

    def _expire(self) -> None:
        oldest = time.time() - RECORD_KEEP_S
        for path in self.dir.glob("*.json"):
            try:
                if path.stat().st_mtime < oldest:
                    path.unlink()
            except OSError:
                pass


def _valid(record) -> bool:
    return (isinstance(record, dict) and record.get("kind") in ("chat", "completion")
            and isinstance(record.get("request_id"), int) and 0 <= record["request_id"] < 1 << 64
            and isinstance(record.get("owner"), str) and _OWNER.fullmatch(record["owner"]) is not None
            and isinstance(record.get("stop"), list) and all(isinstance(s, str) for s in record["stop"])
            and isinstance(record.get("include_usage"), bool) and isinstance(record.get("created"), int)
            and isinstance(record.get("prompt_tokens"), int))
