"""SamplingParams: the options a client may set, validated in one place.

Used by the SDK (to fail fast, before a round trip) and by the sidecar (the
authority: it never trusts a client's validation). Unknown options are errors,
not silently ignored. `seed` makes the output reproducible: the random draw for a
request at generated position i depends only on (seed, i); when a client gives
none the sidecar picks one and records it in the journal so a resumed request
continues exactly as it would have.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from kvhold.protocol.errors import InvalidParams
from kvhold.protocol.layout import MAX_STOP_IDS

DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0      # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidParams(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidParams(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise InvalidParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParams(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidParams(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise InvalidParams(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop_token_ids) > MAX_STOP_IDS:
            raise InvalidParams(f"at most {MAX_STOP_IDS} stop_token_ids")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidParams("stop_token_ids must be non-negative integers")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidParams("ignore_eos must be true or false")

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        if not isinstance(d, dict):
            raise InvalidParams("sampling params must be a map")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidParams(f"unknown sampling option {unknown[0]!r} "
                                f"(known: {', '.join(sorted(known))})")
        d = dict(d)
        if "stop_token_ids" in d:
            if not isinstance(d["stop_token_ids"], (list, tuple)):
                raise InvalidParams("stop_token_ids must be a list of integers")
            d["stop_token_ids"] = tuple(d["stop_token_ids"])
        return cls(**d)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d
