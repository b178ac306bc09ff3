"""SamplingParams and a request's input: the fields a client may set, each with its type and
range, validated in one place.

Every entry point checks a request with these definitions before anything of it is written
anywhere: the SDK (to fail fast, before a round trip), the HTTP API (whose request models take
their bounds from `LIMITS`), the sidecar's admission (the authority: it never trusts a client's
validation), the shared-memory journal's `admit` and the durable journal's reader (a record
read back from disk is checked like a new request). A range is what the journal's record can
hold (kvhold.protocol.layout.REQUEST_DTYPE, token rows of int32) and the sampler can use, so a
value accepted here can always be journaled and restored.

Unknown options are errors, not silently ignored. `seed` makes the output reproducible: the
random draw for a request at generated position i depends only on (seed, i); when a client
gives none the sidecar picks one and records it in the journal so a resumed request
continues exactly as it would have.

`SamplingParams` is also the request's one record of these fields on their whole way: it
travels in the `Generate` message as a nested wire value (a map of its fields, decoded by
`from_dict`, so a bad value gets INVALID_PARAMS), is what `Journal.admit` writes into the
shared-memory record and what a `JournalEntry` reads back, what the executor's `Sequence`
samples with, and the durable journal's record holds it as one map. A new field is declared
here (with its range in `LIMITS`), stored by the journal's record, and used by the sampler;
the layers between pass the record on whole.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvhold.protocol import structured as structured_output
from kvhold.protocol.errors import InvalidParams, InvalidTokenId, PromptTooLarge
from kvhold.protocol.layout import MAX_LOGPROBS, MAX_SEQ_LEN, MAX_STOP_IDS, REQUEST_DTYPE
from kvhold.protocol.wire import nested

DEFAULT_MAX_TOKENS = 16
TOKEN_ID_MAX = int(np.iinfo(np.int32).max)      # journal token rows and stop ids are int32
_F32 = np.finfo(REQUEST_DTYPE["temperature"])


@dataclass(frozen=True, slots=True)
class Limit:
    """The range of one numeric field: integers in [lo, hi], or finite numbers with
    lo < value (lo_open) or lo <= value, and value <= hi."""
    lo: float
    hi: float
    integer: bool = True
    lo_open: bool = False

    def check(self, name: str, v, what: str = "") -> None:
        if isinstance(v, bool) or not isinstance(v, int if self.integer else (int, float)):
            raise InvalidParams(f"{name} must be {self.describe()}, got {show(v)}")
        if not self.integer and not math.isfinite(v):
            raise InvalidParams(f"{name} must be {self.describe()}, got {show(v)}")
        if (v <= self.lo if self.lo_open else v < self.lo) or v > self.hi:
            raise InvalidParams(f"{name} must be {self.describe()}{what}, got {show(v)}")

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        return f"{kind} in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}]"


LIMITS: dict[str, Limit] = {
    # the context of any table geometry bounds a request's length (journal field u4)
    "max_tokens": Limit(1, MAX_SEQ_LEN),
    # generated tokens before a stop id or EOS may end the request; at most max_tokens
    "min_tokens": Limit(0, MAX_SEQ_LEN),
    # stored as float32: the bounds keep the journaled value finite (and top_p above 0)
    "temperature": Limit(0, float(_F32.max), integer=False),
    "top_p": Limit(0, 1, integer=False, lo_open=True),
    "top_k": Limit(0, int(np.iinfo(REQUEST_DTYPE["top_k"]).max)),
    "seed": Limit(0, 2**63 - 1),
    "token_id": Limit(0, TOKEN_ID_MAX),
    # how many most likely tokens to report with each token's log-prob; the pool's
    # --max-logprobs bounds it further (checked at admission)
    "logprobs": Limit(0, MAX_LOGPROBS),
    "prompt_logprobs": Limit(0, MAX_LOGPROBS),
    # vLLM's (and OpenAI's) penalties, stored as float32
    "presence_penalty": Limit(-2, 2, integer=False),
    "frequency_penalty": Limit(-2, 2, integer=False),
    "repetition_penalty": Limit(0, 100, integer=False, lo_open=True),
    "min_p": Limit(0, 1, integer=False),
}
_NOTES = {"temperature": " (0 = greedy)", "top_k": " (0 = off)", "repetition_penalty": " (1 = off)",
          "min_p": " (0 = off)"}
_FLOAT32 = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


@nested
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0           # before this many generated tokens, stop ids and EOS are masked
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None         # each generated token's log-prob and this many top ones
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    # vLLM's penalties, on the raw logits before temperature (kvhold.executor.sampler): presence
    # and frequency over the generated tokens, repetition over the prompt's and generated ones
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0     # 1 = off
    min_p: float = 0.0                  # drop tokens below min_p x the most likely one's probability
    # what the output must match: (kind, spec), kvhold.protocol.structured; None: free text
    structured: tuple[str, ...] | None = None     # a pair
    # OpenAI's logit_bias: (token id, bias) pairs, sorted by id; added to the logits first
    logit_bias: tuple[Any, ...] = ()       # a plain default: first_set compares with it

    def __post_init__(self):
        for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "min_p"):
            LIMITS[name].check(name, getattr(self, name), _NOTES.get(name, ""))
        if self.min_tokens > self.max_tokens:
            raise InvalidParams(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("top_p", "repetition_penalty"):     # what the journal stores must still be above 0
            if np.float32(getattr(self, name)) == 0:
                raise InvalidParams(f"{name} must be {LIMITS[name].describe()} and not 0 as a float32, "
                                    f"got {show(getattr(self, name))}")
        if self.seed is not None:
            LIMITS["seed"].check("seed", self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                LIMITS[name].check(name, getattr(self, name))
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InvalidParams("stop_token_ids must be a list of integers")
        if isinstance(self.stop_token_ids, list):      # the record holds a tuple (it is hashable)
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidParams(f"at most {MAX_STOP_IDS} stop_token_ids")
        check_token_ids(self.stop_token_ids, "stop_token_ids", label="stop token id", error=InvalidParams)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParams("ignore_eos must be true or false")
        object.__setattr__(self, "structured", structured_output.check_shape(self.structured))
        object.__setattr__(self, "logit_bias", structured_output.check_logit_bias(self.logit_bias))

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """The params a map of their fields gives (a client's, a decoded message's, a durable
        record's); InvalidParams naming the first field that does not fit."""
        if not isinstance(d, dict):
            raise InvalidParams("sampling params must be a map")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise InvalidParams(f"unknown sampling option {str(unknown[0])[:64]!r} "
                                f"(known: {', '.join(sorted(known))})")
        d = dict(d)
        if "stop_token_ids" in d:
            if not isinstance(d["stop_token_ids"], (list, tuple)):
                raise InvalidParams("stop_token_ids must be a list of integers")
            d["stop_token_ids"] = tuple(d["stop_token_ids"])
        return cls(**d)

    from_wire_map = from_dict     # how the wire decodes one (kvhold.protocol.wire.nested)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        if self.structured is not None:
            d["structured"] = list(self.structured)
        d["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return d

    @classmethod
    def from_record(cls, **fields) -> "SamplingParams":
        """Params read back from the shared-memory journal's record (every field given), which
        holds only values `Journal.admit` checked: built without checking them again, since
        executors read records on their hot paths."""
        p = object.__new__(cls)
        for name, put in _SLOT_SETTERS:
            put(p, fields[name])          # the slot itself (the class is frozen)
        return p

    def first_set(self, names) -> str | None:
        """The first of the fields `names` not at its default (an engine that cannot honour
        them refuses the request, kvhold.protocol.settings.UNSUPPORTED_SAMPLING), or None."""
        fields = type(self).__dataclass_fields__
        return next((n for n in names if getattr(self, n) != fields[n].default), None)

    def as_journaled(self, seed: int) -> "SamplingParams":
        """These params as the journal holds them: with `seed` (the client's, or the one the
        sidecar picked) and the float fields rounded to float32 (REQUEST_DTYPE), so that
        the durable record, the shared-memory record and the sampler hold the same values."""
        return dataclasses.replace(self, seed=seed, **{n: float(np.float32(getattr(self, n))) for n in _FLOAT32})

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes the logits (the sampler then reads the request's tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


# (field name, the setter of its slot) of every SamplingParams field, for `from_record`
_SLOT_SETTERS = tuple((name, getattr(SamplingParams, name).__set__) for name in SamplingParams.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class RequestInput:
    """A generate request's input, checked: exactly one of `prompt` (text) or `prompt_ids`, the
    tokens of a moved request (`prefix`, see kvhold.protocol.messages.Generate) and its sampling
    options. `vocab_size`, when known, bounds every token id."""
    sampling: SamplingParams
    prompt: str | None
    prompt_ids: list[int] | None
    prefix: list[int]

    @classmethod
    def check(cls, prompt=None, prompt_ids=None, prefix_generated=None,
              params: SamplingParams | dict | None = None, vocab_size: int | None = None) -> "RequestInput":
        """`params`: the SamplingParams, or a map of their fields (checked here)."""
        if (prompt is None) == (prompt_ids is None):
            raise InvalidParams("give exactly one of prompt (text) or prompt_ids")
        sampling = params if isinstance(params, SamplingParams) else SamplingParams.from_dict(params or {})
        if prompt is not None:
            check_text(prompt, "prompt")
            if not prompt:
                raise InvalidParams("the prompt is empty")
        else:
            prompt_ids = check_token_ids(prompt_ids, "prompt_ids", vocab_size, label="token id")
            if not prompt_ids:
                raise InvalidParams("the prompt is empty")
        prefix = check_token_ids(prefix_generated or [], "prefix_generated", vocab_size,
                                 label="resumed token id")
        if prefix and len(prefix) >= sampling.max_tokens:
            raise InvalidParams(f"{len(prefix)} resumed tokens already reach max_tokens "
                                f"({sampling.max_tokens}): nothing left to generate")
        return cls(sampling=sampling, prompt=prompt, prompt_ids=prompt_ids, prefix=prefix)


def check_token_ids(ids, name: str, vocab_size: int | None = None, *, label: str = "token id",
                    error=InvalidTokenId) -> list[int]:
    """`ids` as a list of token ids, each an integer in [0, TOKEN_ID_MAX] and below the
    vocabulary size when one is given; `error` (InvalidTokenId, or InvalidParams) otherwise."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidParams(f"{name} must be a list of token ids, got {type(ids).__name__}")
    # the common case in one pass of builtins (a 2k-token prompt: ~0.1 ms instead of ~0.5);
    # `type(t) is int` is False for bools, as the loop below requires
    if all(type(t) is int for t in ids) and (not ids or (
            min(ids) >= 0 and max(ids) <= TOKEN_ID_MAX and (vocab_size is None or max(ids) < vocab_size))):
        return list(ids)
    for t in ids:                # the first offending id, for the error
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidParams(f"{name} must be a list of integers, got {show(t)}")
        if not 0 <= t <= TOKEN_ID_MAX:
            raise error(f"{label} {show(t)} is not in [0, {TOKEN_ID_MAX}]")
        if vocab_size is not None and t >= vocab_size:
            raise error(f"{label} {t} is outside the vocabulary (size {vocab_size})")
    return list(ids)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text, name: str) -> str:
    """`text` is a string of Unicode characters that UTF-8 can encode (no lone surrogate)."""
    if not isinstance(text, str):
        raise InvalidParams(f"{name} must be a string, got {type(text).__name__}")
    bad = _SURROGATE.search(text)
    if bad is not None:
        raise InvalidParams(f"{name} is not valid Unicode: a lone surrogate "
                            f"(U+{ord(bad.group()):04X}) at character {bad.start()}")
    return text


def check_prompt_size(text: str, limit: int, exact: bool) -> None:
    """PromptTooLarge if `text` exceeds `limit` UTF-8 bytes. Not `exact`: only what its length
    in characters tells (each character is 1-4 bytes), which costs nothing."""
    size = len(text)
    if size <= limit // 4:
        return
    if size > limit:
        raise PromptTooLarge(f"the prompt has {size} characters, more than the limit of {limit} "
                             f"bytes (--max-prompt-bytes)")
    if exact:
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PromptTooLarge(f"the prompt is {size} bytes of UTF-8, more than the limit of "
                                 f"{limit} bytes (--max-prompt-bytes)")


def show(v) -> str:
    """A short repr of a client's value for an error message (huge integers by their size)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {v.bit_length()} bits"
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _num(x) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**64 else f"{x:.9g}"
