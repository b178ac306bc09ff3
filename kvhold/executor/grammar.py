"""Structured output in the executor: each constrained request's grammar matcher, and the tokens
it allows next.

A request whose params carry `structured` (kvhold.protocol.structured) gets a `GrammarState`
when the engine adds it. The state holds an llguidance matcher and how many of the request's
generated tokens it has consumed; before each sampling it catches up with the sequence's tokens
(`allowed`), so it is always a function of the grammar and the generated tokens alone. A
takeover builds the sequence from the journal's committed tokens and the state replays them:
the next mask, and so the next token, are those of an uninterrupted run. A recomputation
(preemption) keeps the tokens, so the state stays.

Once the grammar is complete (the matcher stopped, or it accepts and nothing else may follow)
only EOS is allowed, which ends the request unless it ignores EOS. A matcher in an error state
(a grammar that compiled at admission but exceeds the matcher's limits on this vocabulary, or
tokens the grammar does not allow) allows only EOS, records `error`, and the finish rule
(kvhold.executor.commit.finish_reason) ends the request with ERROR at that token, never
with unconstrained text or a silent `stop`; the same tokens fail the same way after a takeover.

The tokenizer llguidance needs is built once per executor, at warm-up, from the checkpoint's
tokenizer.json, with the model's vocabulary size (logit rows may be wider than the tokenizer's
vocabulary: the extra ids are never allowed) and EOS ids.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from kvhold.protocol.structured import grammar_of, vocabulary

log = logging.getLogger(__name__)


class Grammars:
    """The executor's grammar engine for one model: its llguidance tokenizer, built on first
    use (`warm` builds it ahead, so a takeover never waits for it)."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos: frozenset[int]):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size
        self.eos = tuple(sorted(eos))
        self._tokenizer = None

    @classmethod
    def for_model(cls, model_dir, vocab_size: int, eos) -> "Grammars | None":
        """The grammars of the checkpoint in `model_dir`; None when it has no tokenizer.json."""
        path = Path(model_dir) / "tokenizer.json"
        return cls(path, vocab_size, frozenset(eos)) if path.is_file() else None

    def warm(self) -> None:
        self.tokenizer

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = vocabulary(str(self.tokenizer_json), self.vocab_size, self.eos)
        return self._tokenizer

    def state(self, structured: tuple[str, str], request_id: int) -> "GrammarState":
        import llguidance

        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar_of(structured), log_level=0)
        except Exception as exc:      # noqa: BLE001 - the request fails, never the executor
            return GrammarState(None, self, request_id, f"{type(exc).__name__}: {str(exc)[:300]}")
        return GrammarState(matcher, self, request_id)


class GrammarState:
    """One request's matcher and the generated tokens it has consumed."""

    __slots__ = ("matcher", "grammars", "request_id", "consumed", "error")

    def __init__(self, matcher, grammars: Grammars, request_id: int, error: str = ""):
        self.matcher = matcher
        self.grammars = grammars
        self.request_id = request_id
        self.consumed = 0
        self.error = error           # the matcher's failure (the request then ends with ERROR)

    def allowed(self, generated: list[int]) -> np.ndarray:
        """Which token ids (a bool row of the model's vocabulary) may follow `generated`, the
        request's generated tokens so far."""
        m = self.matcher
        if m is None:                               # it could not be built: the first token ends it
            return self.eos_only() if self.grammars is not None else None
        if self.consumed > len(generated):          # fewer tokens than consumed: start again
            m.reset()
            self.consumed = 0
        for token in generated[self.consumed:]:
            if m.is_stopped() or m.is_error():
                break
            m.consume_token(token)
        self.consumed = len(generated)
        vocab = self.grammars.vocab_size
        if m.is_error() or m.is_stopped():
            if m.is_error() and not self.error:
                self.error = m.get_error()[:300] or "failed"
                log.warning("request %#x: its grammar matcher failed (%s): the request ends with an error",
                            self.request_id, self.error)
            return self.eos_only()
        bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        if m.is_error():
            return self.allowed(generated)         # records the error, allows EOS
        row = np.unpackbits(bits, bitorder="little")[:vocab].astype(bool)
        if len(row) < vocab:
            row = np.concatenate([row, np.zeros(vocab - len(row), bool)])
        if not row.any():                # nothing the grammar allows: end the request
            return self.eos_only()
        return row

    def eos_only(self) -> np.ndarray:
        row = np.zeros(self.grammars.vocab_size, bool)
        row[[t for t in self.grammars.eos if t < len(row)]] = True
        return row
