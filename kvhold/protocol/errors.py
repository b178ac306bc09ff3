"""Error codes carried on the wire, and the typed exceptions the SDK raises for them."""
from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    BAD_MESSAGE = 1      # not msgpack, or not a [version, type, body] envelope
    TOO_LARGE = 2
    BAD_VERSION = 3
    UNKNOWN_TYPE = 4
    BAD_FIELD = 5        # body does not match the message schema
    UNAUTHORIZED = 6
    NOT_FOUND = 7
    INVALID_PARAMS = 8
    PROMPT_TOO_LONG = 9
    INVALID_TOKEN = 10
    OVERLOADED = 11
    SHUTTING_DOWN = 12
    FENCED = 13
    INTERNAL = 14
    UNAVAILABLE = 15     # raised by the SDK itself: no answer from the sidecar in time
    PROMPT_TOO_LARGE = 16  # the prompt's text (or the message carrying it) exceeds the sidecar's limit
    REQUEST_FAILED = 17  # the request killed the executors that ran it: failed, not retried


class KvholdError(Exception):
    code = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ProtocolError(KvholdError):
    code = ErrorCode.BAD_MESSAGE


class Unauthorized(KvholdError):
    code = ErrorCode.UNAUTHORIZED


class NotFound(KvholdError):
    code = ErrorCode.NOT_FOUND


class InvalidParams(KvholdError, ValueError):
    code = ErrorCode.INVALID_PARAMS


class PromptTooLong(InvalidParams):
    code = ErrorCode.PROMPT_TOO_LONG


class PromptTooLarge(InvalidParams):
    """The prompt is larger than the sidecar accepts (`--max-prompt-bytes`); HTTP answers 413."""
    code = ErrorCode.PROMPT_TOO_LARGE


class InvalidTokenId(InvalidParams):
    code = ErrorCode.INVALID_TOKEN


class Overloaded(KvholdError):
    code = ErrorCode.OVERLOADED


class ShuttingDown(KvholdError):
    code = ErrorCode.SHUTTING_DOWN


class FencedError(KvholdError):
    code = ErrorCode.FENCED


class SidecarUnavailable(KvholdError, TimeoutError):
    code = ErrorCode.UNAVAILABLE


class InternalError(KvholdError):
    code = ErrorCode.INTERNAL


class RequestFailed(KvholdError):
    """The request itself crashes the engine: executors died with it in their step until the
    sidecar failed it (kvhold.sidecar.request_deaths). Retrying it unchanged fails again."""
    code = ErrorCode.REQUEST_FAILED


_BY_CODE: dict[int, type[KvholdError]] = {
    ErrorCode.BAD_MESSAGE: ProtocolError, ErrorCode.TOO_LARGE: ProtocolError,
    ErrorCode.BAD_VERSION: ProtocolError, ErrorCode.UNKNOWN_TYPE: ProtocolError,
    ErrorCode.BAD_FIELD: ProtocolError, ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.NOT_FOUND: NotFound, ErrorCode.INVALID_PARAMS: InvalidParams,
    ErrorCode.PROMPT_TOO_LONG: PromptTooLong, ErrorCode.INVALID_TOKEN: InvalidTokenId,
    ErrorCode.OVERLOADED: Overloaded, ErrorCode.SHUTTING_DOWN: ShuttingDown,
    ErrorCode.FENCED: FencedError, ErrorCode.INTERNAL: InternalError,
    ErrorCode.UNAVAILABLE: SidecarUnavailable, ErrorCode.PROMPT_TOO_LARGE: PromptTooLarge,
    ErrorCode.REQUEST_FAILED: RequestFailed,
}


def error_from_code(code: int, message: str) -> KvholdError:
    """The typed exception for a wire error code (unknown codes become InternalError)."""
    try:
        ec = ErrorCode(code)
    except ValueError:
        return InternalError(f"[code {code}] {message}")
    return _BY_CODE.get(ec, InternalError)(message, ec)
