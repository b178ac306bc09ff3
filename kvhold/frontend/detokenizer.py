"""Incremental detokenization: text for each streamed token, never a broken character.

Decodes a short sliding window (as vLLM does) rather than the whole sequence per
token. A token that ends inside a multi-byte UTF-8 character yields "" until the
character completes; `flush` returns whatever is left at the end of a stream.
"""
from __future__ import annotations

CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids):
        self.tokenizer = tokenizer
        self.ids: list[int] = [int(t) for t in list(prompt_ids)[-CONTEXT_TOKENS:]]
        self.prefix = 0
        self.read = len(self.ids)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            if self.prefix > 64:  # tokens before the window are never decoded again
                self.ids = self.ids[self.prefix:]
                self.read -= self.prefix
                self.prefix = 0
            return delta
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
