"""Log-probs in OpenAI's formats, from the SDK's TokenLogprob entries (kvhold.client.client).

The values are the model's raw distribution (log_softmax of its logits before temperature,
top-k or top-p), what vLLM reports by default (its `logprobs_mode` raw_logprobs). Each token is
shown as the text of that token alone (`tokenizer.decode([id])`, as vLLM shows the alternatives;
a token that is only part of a UTF-8 character decodes to U+FFFD), or `token_id:<id>` when the
server has no tokenizer (vLLM's --return-tokens-as-token-ids form); `bytes` are that text's UTF-8.

* completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; each
  `top_logprobs` entry maps the k most likely tokens' texts to their log-probs, the chosen
  token's included (as OpenAI and vLLM do); a prompt's first token, echoed, has None for both;
  `text_offset` is each token's offset in the choice's text, counted over the token texts.
* chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}]}`, `top_logprobs` the k most likely, most likely first.
* vLLM's `prompt_logprobs` (a completion choice's, a chat response's): per prompt token, None
  for the first, then {token id: {"logprob", "rank", "decoded_token"}}.
"""
from __future__ import annotations

import math


class LogprobFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = (self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer is not None
                 else f"token_id:{token_id}")
            if len(self._cache) < 1 << 16:
                self._cache[token_id] = s
        return s

    def completion(self, entries, offset: int = 0) -> tuple[dict, int]:
        """The completions `logprobs` object of `entries`, their offsets from `offset`; and the
        offset after them (a stream's next chunk continues from it)."""
        tokens, lps, tops, offsets = [], [], [], []
        for e in entries:
            s = self.text(e.token_id)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            if e.logprob is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(_num(e.logprob))
            top = {self.text(t): _num(lp) for t, lp in e.top}
            top.setdefault(s, _num(e.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset

    def chat(self, entries) -> dict:
        """The chat `logprobs` object of `entries`."""
        def one(token_id: int, lp: float) -> dict:
            s = self.text(token_id)
            return {"token": s, "logprob": _num(lp), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries]}


    def prompt(self, entries) -> list:
        """vLLM's `prompt_logprobs`: None for the first token, then for each token a map of token
        id to {"logprob", "rank", "decoded_token"}: the token itself and the k most likely there
        (ranks 1..k)."""
        out = []
        for e in entries:
            if e.logprob is None:
                out.append(None)
                continue
            d = {str(t): {"logprob": _num(lp), "rank": r, "decoded_token": self.text(t)}
                 for r, (t, lp) in enumerate(e.top, 1)}
            d[str(e.token_id)] = {"logprob": _num(e.logprob), "rank": e.rank, "decoded_token": self.text(e.token_id)}
            out.append(d)
        return out


def _num(x: float) -> float:
    """A log-prob JSON can carry: -inf (a float32 underflow of a hopeless token) as -9999.0, as
    vLLM does."""
    return x if math.isfinite(x) else -9999.0
