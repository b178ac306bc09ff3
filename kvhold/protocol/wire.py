"""Wire codec: typed, versioned msgpack messages with one decoder.

Frame = one ZeroMQ frame holding msgpack ``[PROTOCOL_VERSION, type, body]`` where
`type` names a registered message dataclass and `body` is a map of its fields.
`decode` is the only way bytes become messages. It enforces, in order: the frame
size limit, msgpack's own length limits, the envelope shape, the version, a known
type, and the schema (every required field present, no unknown field, each value
of the declared type). Every failure raises `WireError` carrying the error code
the peer is sent back; nothing else escapes for any input bytes.
A field may hold a `nested` dataclass: it travels as a map of its fields and is
checked like a message body (required fields, no unknown field, declared types), or, for
a type that checks itself (`from_wire_map`, e.g. kvhold.protocol.sampling.SamplingParams),
by its own check, whose typed error (a KvholdError) keeps its code.
"""
from __future__ import annotations

import dataclasses
import threading
import types
import typing
from typing import Any, Callable

import msgpack

from kvhold.protocol.errors import ErrorCode, KvholdError

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 << 20
_UNPACK_LIMITS = dict(max_str_len=MAX_FRAME_BYTES, max_bin_len=MAX_FRAME_BYTES,
                      max_array_len=1 << 21, max_map_len=4096, max_ext_len=0)
_INT64 = (-(1 << 63), (1 << 64) - 1)


class WireError(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


_REGISTRY: dict[str, type] = {}
_CHECKERS: dict[str, dict[str, Callable[[Any], Any]]] = {}
_NESTED: dict[type, dict[str, Callable[[Any], Any]]] = {}
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}     # a message type's fields, in order (encode)


def _checker(tp) -> Callable[[Any], Any]:
    """Build a function that validates (and lightly normalises) one value of type `tp`."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return lambda v: v
    if tp in _NESTED:
        return lambda v: from_map(tp, v)
    if origin is typing.Union or origin is types.UnionType:
        inner = [_checker(a) for a in args if a is not type(None)]
        allow_none = type(None) in args

        def check_union(v):
            if v is None and allow_none:
                return None
            errors = []
            for c in inner:
                try:
                    return c(v)
                except (TypeError, ValueError) as exc:
                    errors.append(str(exc))
            raise TypeError("; ".join(errors))
        return check_union
    if tp is bool:
        def check_bool(v):
            if not isinstance(v, bool):
                raise TypeError(f"expected bool, got {type(v).__name__}")
            return v
        return check_bool
    if tp is int:
        def check_int(v):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"expected int, got {type(v).__name__}")
            if not _INT64[0] <= v <= _INT64[1]:
                raise ValueError("integer out of range")
            return v
        return check_int
    if tp is float:
        def check_float(v):
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"expected number, got {type(v).__name__}")
            return float(v)
        return check_float
    if tp in (str, bytes):
        def check_scalar(v):
            if not isinstance(v, tp):
                raise TypeError(f"expected {tp.__name__}, got {type(v).__name__}")
            return v
        return check_scalar
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        each = _checker(args[0])

        def check_tuple(v):
            if not isinstance(v, (list, tuple)):
                raise TypeError(f"expected list, got {type(v).__name__}")
            return tuple(each(x) for x in v)
        return check_tuple
    if origin is list:
        item = _checker(args[0]) if args else (lambda v: v)

        def check_list(v):
            if not isinstance(v, list):
                raise TypeError(f"expected list, got {type(v).__name__}")
            return [item(x) for x in v]
        return check_list
    if origin is dict or tp is dict:
        def check_dict(v):
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise TypeError("expected a map with string keys")
            return v
        return check_dict
    raise TypeError(f"unsupported wire field type {tp!r}")


def message(type_name: str):
    """Register a frozen dataclass as the wire message `type_name`."""
    def register(cls):
        cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
        if type_name in _REGISTRY:
            raise ValueError(f"wire type {type_name!r} registered twice")
        hints = typing.get_type_hints(cls)
        cls.TYPE = type_name
        _REGISTRY[type_name] = cls
        _CHECKERS[type_name] = {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}
        _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
        return cls
    return register


def nested(cls):
    """Register a frozen dataclass as a value that message fields (or other nested types) may hold.
    A class with a `from_wire_map(data)` classmethod builds itself from its map, checking every
    field its own way; any other is checked field by field against its declared types."""
    cls = dataclasses.dataclass(frozen=True, slots=True)(cls)
    hints = typing.get_type_hints(cls)
    _NESTED[cls] = {f.name: _checker(hints[f.name]) for f in dataclasses.fields(cls)}
    return cls


def to_map(obj) -> dict:
    """A nested value as the map of its fields (msgpack's hook for one, and JSON's)."""
    if type(obj) not in _NESTED:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def from_map(cls, data):
    """The nested value of type `cls` that `data` (a map of its fields) describes, checked as a
    message body is; TypeError or ValueError naming the field when it does not fit (or the
    class's own error, from its `from_wire_map`)."""
    own = getattr(cls, "from_wire_map", None)
    if own is not None:
        return own(data)
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise TypeError(f"expected a {cls.__name__} map")
    return cls(**_check_fields(cls, _NESTED[cls], data))


class _Packers(threading.local):
    """A msgpack packer per thread, reused (packb builds one per call)."""

    def __init__(self):
        self.packer = msgpack.Packer(use_bin_type=True, default=to_map)


_PACKERS = _Packers()


def encode(msg) -> bytes:
    names = _FIELD_NAMES.get(type(msg)) or tuple(f.name for f in dataclasses.fields(msg))
    body = {name: getattr(msg, name) for name in names}
    data = _PACKERS.packer.pack([PROTOCOL_VERSION, msg.TYPE, body])
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(ErrorCode.TOO_LARGE, f"{msg.TYPE} encodes to {len(data)} bytes")
    return data


def decode(data: bytes, allowed: frozenset[str] | None = None, max_array_len: int | None = None):
    """Bytes -> message instance, or WireError. `allowed` restricts the accepted types;
    `max_array_len` lowers the longest list accepted (refused before it is built)."""
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(ErrorCode.TOO_LARGE, f"frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
    limits = _UNPACK_LIMITS if max_array_len is None else dict(_UNPACK_LIMITS, max_array_len=max_array_len)
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True, **limits)
    except ValueError as exc:
        if "max_array_len" in str(exc):
            raise WireError(ErrorCode.TOO_LARGE, f"a list of the message is too long: {exc}") from None
        raise WireError(ErrorCode.BAD_MESSAGE, f"not msgpack: {type(exc).__name__}") from None
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, ...
        raise WireError(ErrorCode.BAD_MESSAGE, f"not msgpack: {type(exc).__name__}") from None
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise WireError(ErrorCode.BAD_MESSAGE, "envelope must be [version, type, body]")
    version, type_name, body = envelope
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise WireError(ErrorCode.BAD_VERSION,
                        f"protocol version {version!r}, expected {PROTOCOL_VERSION}")
    if not isinstance(type_name, str) or type_name not in _REGISTRY:
        raise WireError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {str(type_name)[:64]!r}")
    if allowed is not None and type_name not in allowed:
        raise WireError(ErrorCode.UNKNOWN_TYPE, f"{type_name!r} is not accepted on this socket")
    if not isinstance(body, dict):
        raise WireError(ErrorCode.BAD_FIELD, "body must be a map")
    return _build(type_name, body)


def peek_tag(data: bytes) -> int:
    """The `tag` of an encoded message whose body begins with it (every tagged message), read
    without decoding the rest, so that an error about a frame reaches the call that sent it;
    0 when there is none."""
    import io

    try:
        unpacker = msgpack.Unpacker(io.BytesIO(data[:MAX_FRAME_BYTES]), raw=False, read_size=256,
                                    **_UNPACK_LIMITS)
        if unpacker.read_array_header() != 3:
            return 0
        unpacker.skip()
        unpacker.skip()
        if unpacker.read_map_header() < 1 or unpacker.unpack() != "tag":
            return 0
        tag = unpacker.unpack()
    except Exception:   # anything msgpack raises: no tag to be had
        return 0
    return tag if type(tag) is int and 0 <= tag <= _INT64[1] else 0


def _build(type_name: str, body: dict):
    cls = _REGISTRY[type_name]
    try:
        return cls(**_check_fields(cls, _CHECKERS[type_name], body))
    except KvholdError as exc:       # a nested value's own check: its code (e.g. INVALID_PARAMS)
        raise WireError(exc.code, f"{type_name}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise WireError(ErrorCode.BAD_FIELD, f"{type_name}: {exc}") from None


def _check_fields(cls, checkers: dict[str, Callable[[Any], Any]], body: dict) -> dict:
    """The checked values of `body` for the fields of `cls`; TypeError or ValueError if it does not fit."""
    unknown = set(body) - set(checkers)
    if unknown:
        raise ValueError(f"unknown field {sorted(map(str, unknown))[0][:64]!r}")
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"missing field {f.name!r}")
            continue
        try:
            values[f.name] = checkers[f.name](body[f.name])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{f.name}: {exc}") from None
    return values


def checked(cls, body: dict):
    """The message of registered type `cls` that `body` (a map of its fields) describes, each
    field checked as a received message's is; TypeError or ValueError naming the field."""
    if not isinstance(body, dict) or not all(isinstance(k, str) for k in body):
        raise TypeError(f"expected a {cls.__name__} map")
    return cls(**_check_fields(cls, _CHECKERS[cls.TYPE], body))


def registered_types() -> frozenset[str]:
    return frozenset(_REGISTRY)
