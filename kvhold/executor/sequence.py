"""Sequence: one request as the engine sees it (tokens, KV progress, pages, sampling)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvhold.protocol.journal import JournalEntry
from kvhold.protocol.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # needs pages before it can run
    RUNNING = "running"


@dataclass(slots=True)
class Sequence:
    slot: int
    request_id: int
    prompt_len: int
    tokens: list[int]                 # prompt + generated, mirrors the journal row
    sampling: SamplingParams          # as journaled (kvhold.protocol.sampling)
    num_computed: int = 0             # tokens whose KV is in the pool and committed
    pages: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    lp_done: int = 0                    # positions whose log-probs are final (the journal's)
    eos: frozenset[int] = frozenset()   # the model's EOS ids (the engine sets them)
    page_keys: list[int] = field(default_factory=list)   # prefix-cache keys of its full pages so far
    cached_upto: int = 0                # its first pages the prefix cache has looked at
    num_cached: int = 0                 # tokens it found in the prefix cache when it started
    grammar: object | None = None       # its structured output's matcher (kvhold.executor.grammar)

    @classmethod
    def from_journal(cls, entry: JournalEntry, tokens: list[int]) -> "Sequence":
        return cls(slot=entry.slot, request_id=entry.request_id, prompt_len=entry.prompt_len,
                   tokens=tokens, sampling=entry.sampling, lp_done=entry.lp_done)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    def logprobs_at(self, position: int) -> int | None:
        """Top log-probs the request asks for at token `position` (None: no log-probs there)."""
        return self.sampling.prompt_logprobs if position < self.prompt_len else self.sampling.logprobs

    def allowed_ids(self):
        """With structured output, which token ids (a bool numpy row over the vocabulary) may
        come next; None without."""
        return self.grammar.allowed(self.tokens[self.prompt_len:]) if self.grammar is not None else None

    def masked_ids(self) -> tuple[int, ...]:
        """Token ids the sampler may not pick next: before `min_tokens` generated tokens, the
        stop ids and (unless ignore_eos) EOS, which would end the request (vLLM's min_tokens);
        none after."""
        p = self.sampling
        if self.num_generated >= p.min_tokens:
            return ()
        return tuple(sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)))
