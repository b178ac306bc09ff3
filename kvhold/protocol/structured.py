"""Structured output: what a request's generated text must match, and how it is journaled.

A request's `SamplingParams.structured` is `(kind, spec)`:

    json      a JSON schema (the text of one JSON object); `{"type": "object"}` is any object
    regex     a regular expression the whole output matches
    choice    a JSON list of strings: the output is one of them
    grammar   a context-free grammar, Lark or GBNF (llama.cpp's), as vLLM's guided_grammar

llguidance (a well-kept grammar engine, no dependencies) compiles it into the grammar its
matcher runs (`grammar_of`). JSON is compact unless the schema's `x-guidance` says otherwise
(no whitespace between tokens), so a model cannot spend its tokens on spaces. `check` compiles
a spec and turns any problem into InvalidParams naming it: the HTTP API and the sidecar's
admission call it before a request is journaled, so an executor only ever meets grammars that
compile.

The spec is of variable length, so the journal keeps it in its extras area (one row of
`max_extra_bytes` per slot, kvhold.protocol.layout) as msgpack: `pack_extras` / `unpack_extras`,
with the request's other option of variable length, `logit_bias` (OpenAI's: token id -> a bias
in [-100, 100] added to its logit; up to MAX_LOGIT_BIAS entries, LOGIT_BIAS_BYTES of the row).
The executor's matcher state is never journaled: it is a function of the grammar and the
request's committed generated tokens, so a takeover rebuilds it exactly (kvhold.executor.grammar).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import msgpack

from kvhold.protocol.errors import InvalidParams

KINDS = ("json", "regex", "choice", "grammar")
MAX_GRAMMAR_BYTES = 1 << 20          # the most --max-grammar-bytes may be
EXTRAS_OVERHEAD = 64                 # msgpack framing around a spec of the limit's size
MAX_LOGIT_BIAS = 1024                # entries of a request's logit_bias
LOGIT_BIAS_BYTES = 16 * 1024         # their room in the row (an entry packs to at most 15 bytes)
LOGIT_BIAS_LIMIT = 100.0             # |bias|, as OpenAI's
JSON_DEFAULTS = {"whitespace_flexible": False}     # compact JSON unless the schema says otherwise
ANY_OBJECT = '{"type": "object"}'    # response_format json_object


def extra_bytes_for(max_grammar_bytes: int) -> int:
    """The journal's extras row (layout.TableGeometry.max_extra_bytes) for specs of up to
    `max_grammar_bytes` bytes, and a logit_bias."""
    return max_grammar_bytes + LOGIT_BIAS_BYTES + EXTRAS_OVERHEAD


def grammar_room(max_extra_bytes: int) -> int:
    """The spec bytes an extras row of `max_extra_bytes` takes (0: no structured output)."""
    return max(0, max_extra_bytes - LOGIT_BIAS_BYTES - EXTRAS_OVERHEAD)


def check_logit_bias(value) -> tuple[tuple[int, float], ...]:
    """A logit_bias (a map of token id, or its decimal string, to a bias; or (id, bias) pairs,
    as the wire and the journal hold it) as sorted (id, bias) pairs; InvalidParams otherwise.
    Token ids are bounded by the vocabulary at admission."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple, type({}.items()))):
        raise InvalidParams("logit_bias must be a map of token ids to biases")
    out = {}
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise InvalidParams("logit_bias must be a map of token ids to biases")
        key, bias = item
        if isinstance(key, str) and key.strip().isascii() and key.strip().isdigit():
            key = int(key)
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**31:
            raise InvalidParams(f"logit_bias keys must be token ids, got {str(key)[:40]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise InvalidParams(f"logit_bias values must be numbers in [-100, 100], got {str(bias)[:40]!r} "
                                f"for token {key}")
        out[key] = float(bias)
    if len(out) > MAX_LOGIT_BIAS:
        raise InvalidParams(f"logit_bias has {len(out)} entries, more than {MAX_LOGIT_BIAS}")
    return tuple(sorted(out.items()))


def check_shape(value) -> tuple[str, str] | None:
    """`value` (None, or a (kind, spec) pair as a tuple or a wire list) as the params hold it;
    InvalidParams for anything else. Cheap: the spec is not compiled here (see `check`)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise InvalidParams("structured must be a pair [kind, spec]")
    kind, spec = value
    if kind not in KINDS:
        raise InvalidParams(f"structured output kind must be one of {', '.join(KINDS)}, got {str(kind)[:40]!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidParams(f"the {kind} of structured output must be a non-empty string")
    if len(spec) > MAX_GRAMMAR_BYTES:
        raise InvalidParams(f"the {kind} of structured output has {len(spec)} characters, more than "
                            f"{MAX_GRAMMAR_BYTES}")
    return (kind, spec)


MIN_LLGUIDANCE = (1, 9)     # older releases take one eos id in LLTokenizer (the model's eos list fails)


@functools.cache
def engine_version() -> tuple[int, ...] | None:
    """The installed llguidance's version (its first two numbers), None where it is missing."""
    from importlib import metadata

    try:
        text = metadata.version("llguidance")
    except metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def _llguidance():
    version = engine_version()
    if version is not None and version < MIN_LLGUIDANCE:
        raise InvalidParams(f"structured output: this server's llguidance {'.'.join(map(str, version))} is older "
                            f"than {'.'.join(map(str, MIN_LLGUIDANCE))}, which kvhold needs "
                            f"(pip install 'llguidance>={'.'.join(map(str, MIN_LLGUIDANCE))}')")
    try:
        import llguidance
    except ImportError:
        raise InvalidParams("structured output: this server has no grammar engine (pip install "
                            "llguidance, part of kvhold[engine])") from None
    return llguidance


def grammar_of(structured: tuple[str, str]) -> str:
    """llguidance's grammar for a (kind, spec) pair; InvalidParams when the spec cannot be
    read (not JSON where JSON is due, a GBNF grammar that does not parse)."""
    llguidance = _llguidance()

    kind, spec = structured
    if kind == "json":
        schema = _json(spec, "JSON schema")
        if not isinstance(schema, dict):
            raise InvalidParams("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = _json(spec, "list of choices")
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidParams("the choices must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    try:
        return llguidance.grammar_from("grammar", spec)
    except ValueError as exc:
        raise InvalidParams(f"the grammar does not parse: {exc}") from None


def check(structured: tuple[str, str] | None) -> None:
    """InvalidParams, naming the problem, unless the spec compiles."""
    if structured is None:
        return
    llguidance = _llguidance()
    grammar = grammar_of(structured)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidParams(f"invalid {_NAMES[structured[0]]}: {error.strip()[:500]}")


@functools.lru_cache(maxsize=4)
def vocabulary(tokenizer_json: str, vocab_size: int, eos: tuple[int, ...]):
    """llguidance's tokenizer for a checkpoint's tokenizer.json, built once per process: rows of
    `vocab_size` (logit rows may be wider than the tokenizer's vocabulary: the extra ids are never
    allowed), `eos` the ids that end a completed output."""
    return _llguidance().LLTokenizer(Path(tokenizer_json).read_text(), n_vocab=vocab_size,
                                     eos_token=list(eos) or None)


def check_on_vocabulary(structured: tuple[str, str] | None, tokenizer) -> None:
    """InvalidParams, naming the problem, unless the spec also builds a matcher on this model's
    vocabulary (`vocabulary`): some specs compile alone and fail only there."""
    if structured is None:
        return
    try:
        matcher = _llguidance().LLMatcher(tokenizer, grammar_of(structured), log_level=0)
        error = matcher.get_error() if matcher.is_error() else ""
    except Exception as exc:          # noqa: BLE001 - any failure here is the spec's
        error = f"{type(exc).__name__}: {exc}"
    if error:
        raise InvalidParams(f"the {_NAMES[structured[0]]} cannot be matched with this model's vocabulary: "
                            f"{error.strip()[:500]}")


def pack_extras(structured: tuple[str, str] | None, logit_bias=()) -> bytes:
    """A request's row in the journal's extras area (b"" when it has nothing there)."""
    d = {}
    if structured is not None:
        d["structured"] = list(structured)
    if logit_bias:
        d["logit_bias"] = [list(pair) for pair in logit_bias]
    return msgpack.packb(d) if d else b""


def unpack_extras(blob: bytes) -> dict:
    """The fields `pack_extras` wrote: {"structured": (kind, spec) | None, "logit_bias": pairs}."""
    d = msgpack.unpackb(blob) if blob else {}
    s = d.get("structured")
    return {"structured": tuple(s) if s is not None else None,
            "logit_bias": tuple((int(t), float(b)) for t, b in d.get("logit_bias", ()))}


_NAMES = {"json": "JSON schema", "regex": "regular expression", "choice": "list of choices",
          "grammar": "grammar"}


def _json(spec: str, what: str):
    try:
        return json.loads(spec)
    except ValueError as exc:
        raise InvalidParams(f"the {what} is not valid JSON: {exc}") from None
