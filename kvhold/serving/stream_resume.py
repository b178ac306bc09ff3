"""Streams that outlive the HTTP server: SSE event ids and the resume route.

Under `kvhold serve` the HTTP server is a process of its own (kvhold.serving.serve): when it
dies, its clients' connections break but the sidecar keeps their requests, held for their
owner (kvhold.frontend.restore). A restarted HTTP server presents the same ZeroMQ routing id
from the same uid, so the sidecar knows it as the same owner, and a client takes its stream
up again:

    GET /v1/streams/{request_id}          Last-Event-ID: <request id hex>-<N>

Every event of a streamed /v1/completions or /v1/chat/completions response carries an id,
`<request id hex>-<N>` (kvhold.serving.generation.EventIds: N counts the request's tokens the
text through that event covers; the end's events continue from there). The route answers
`text/event-stream` with the events after the one named, exactly as the original stream
would have sent them (same chunk objects, ids, finish chunk, usage chunk when asked for,
then `data: [DONE]`); without Last-Event-ID it sends the whole stream from its first event.
`request_id` is the id's hex part (or the response's id, `cmpl-<hex>` / `chatcmpl-<hex>`).

How: when a streamed response starts, what the sidecar does not know of it (endpoint, stop
strings, include_usage, created, prompt tokens) is written to a small file under the
instance's runtime directory (`http-streams/`), removed when the response ends here. The
resume route reads it, asks the sidecar for the request's tokens from the first
(`AsyncClient.attach`: a request that ended while no HTTP server was up comes from its kept
result), replays them through the same text and stop-string logic, and sends only the events
after Last-Event-ID. A client that goes away cancels the request, as on the original stream.

Answers: 400 for a malformed Last-Event-ID or request id, or a Last-Event-ID of another
request; 404 when there is nothing to resume (no such stream streamed here, or the sidecar
no longer has it: delivered, cancelled (a stream no client claimed within the sidecar's
--unclaimed-cancel-s), or another's); 409 while the stream is still being sent on another
connection; 501 on a server that does not resume streams (`kvhold router`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from kvhold.serving.openai_schema import ApiError, bad_request

log = logging.getLogger(__name__)
RECORD_KEEP_S = 3600.0          # a record left by a server that died is removed at a start after this
_EVENT_ID = re.compile(r"([0-9a-f]{1,16})-(0|[1-9][0-9]{0,9})")
_REQUEST_ID = re.compile(r"(?:chatcmpl-|cmpl-)?([0-9a-f]{1,16})")


def parse_request_id(text: str) -> int:
    """The request id of the route's path: hex, or a response id (cmpl-<hex>, chatcmpl-<hex>)."""
    match = _REQUEST_ID.fullmatch(text)
    if match is None:
        raise bad_request(f"{text[:80]!r} is not a request id: want the hex id of an event id "
                          "(<request id>-<N>) or a response id (cmpl-<hex>, chatcmpl-<hex>)",
                          param="request_id", code="invalid_request_id")
    return int(match.group(1), 16)


def parse_last_event_id(text: str | None, request_id: int) -> int:
    """The N of a Last-Event-ID `<request id hex>-<N>` naming `request_id`; -1 when there is none."""
    if text is None:
        return -1
    match = _EVENT_ID.fullmatch(text.strip())
    if match is None:
        raise bad_request(f"Last-Event-ID {text[:80]!r} is not an event id of this server: want "
                          "<request id hex>-<N>, as in the stream's 'id:' lines",
                          param="Last-Event-ID", code="invalid_last_event_id")
    if int(match.group(1), 16) != request_id:
        raise bad_request(f"Last-Event-ID {text.strip()!r} names request {match.group(1)}, not "
                          f"{request_id:x}", param="Last-Event-ID", code="invalid_last_event_id")
    return int(match.group(2))


def not_found(request_id: int, why: str) -> ApiError:
    return ApiError(404, f"no stream of request {request_id:x} to resume: {why}", type="not_found_error",
                    param="request_id", code="stream_not_found")


class StreamRecords:
    """What a resume needs of a streamed response and the sidecar does not keep: one small file
    per stream under `directory` (0700, the instance's runtime directory)."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._expire()

    def path(self, request_id: int) -> Path:
        return self.dir / f"{request_id:016x}.json"

    def write(self, request_id: int, record: dict) -> None:
        tmp = self.dir / f".{request_id:016x}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path(request_id))

    def read(self, request_id: int) -> dict | None:
        try:
            record = json.loads(self.path(request_id).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("stream record of request %#x unreadable: %s", request_id, exc)
            return None
        return record if _valid(record) else None

    def remove(self, request_id: int) -> None:
        self.path(request_id).unlink(missing_ok=True)

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
            and isinstance(record.get("stop"), list) and all(isinstance(s, str) for s in record["stop"])
            and isinstance(record.get("include_usage"), bool) and isinstance(record.get("created"), int)
            and isinstance(record.get("prompt_tokens"), int))
