"""vLLM's log-probs as the journal's logprob area holds them (kvhold.protocol.layout.logprob_dtype).

The bridge asks vLLM for `SamplingParams(logprobs=k, flat_logprobs=True)` (and `prompt_logprobs=k`
for known tokens whose log-probs the journal does not hold yet), with `logprobs_mode="raw_logprobs"`:
log_softmax of the model's logits, before temperature, top-k/top-p and logits processors
(`KeyedSampling`, which sets every logit but the picked token's to -inf, runs after), the
distribution kvhold's engine reports (kvhold.executor.sampler.token_logprobs).

vLLM 0.32 returns them as a `vllm.logprobs.FlatLogprobs`: per position, the entries
`start_indices[i]:end_indices[i]` of its flat lists `token_ids`, `logprobs`, `ranks`, the
position's own token first (the sampled token, or the prompt token) with its rank, then the
top k with ranks 1..k (the own token again if it is among them). `rows` reads the positions
asked for into the journal's arrays: the token's log-prob and rank, the top k sorted by log-prob,
ties by lower id (as kvhold's engine sorts them; torch.topk orders ties as it likes).

Compared with kvhold's own engine (documented in docs/VLLM_BRIDGE.md): vLLM computes the
log_softmax in float32 where kvhold's engine computes it in float64 on CPU (both stored as
float32: they may differ in the last bits), and vLLM's rank counts the tokens at least as likely
as the token itself (`(logprobs >= own).sum()`), kvhold's 1 + those strictly more likely: the same
unless another token's log-prob equals the token's exactly.
"""
from __future__ import annotations

import numpy as np


def rows(flat, indices, tokens, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(log-prob [n] float32, rank [n] int32, top ids [n, k] int32, top log-probs [n, k] float32)
    of positions `indices` of `flat` (a vLLM FlatLogprobs: `start_indices`, `end_indices`,
    `token_ids`, `logprobs`, `ranks`), whose own tokens must be `tokens`; the top lists cut to
    `k` (vLLM gives the k the request asked for). Raises ValueError where the structure is not
    that (another layout: vLLM's list of dicts loses the own token's rank when it is in the top)."""
    if not all(hasattr(flat, a) for a in ("start_indices", "end_indices", "token_ids", "logprobs", "ranks")):
        raise ValueError(f"vLLM log-probs as {type(flat).__name__}: the bridge reads FlatLogprobs "
                         "(SamplingParams(flat_logprobs=True))")
    n = len(indices)
    lp = np.zeros(n, dtype=np.float32)
    rank = np.zeros(n, dtype=np.int32)
    top_ids = np.zeros((n, k), dtype=np.int32)
    top_lps = np.zeros((n, k), dtype=np.float32)
    for row, (i, token) in enumerate(zip(indices, tokens)):
        a, b = flat.start_indices[i], flat.end_indices[i]
        if b <= a or flat.token_ids[a] != token:
            raise ValueError(f"vLLM log-probs of position {i}: "
                             f"{'none' if b <= a else f'token {flat.token_ids[a]}'}, not token {token}")
        if b - a - 1 < k:
            raise ValueError(f"vLLM log-probs of position {i}: {b - a - 1} top entries, {k} asked for")
        lp[row] = flat.logprobs[a]
        rank[row] = flat.ranks[a]
        top = sorted(zip(flat.logprobs[a + 1:b], flat.token_ids[a + 1:b]), key=lambda t: (-t[0], t[1]))[:k]
        if top:
            top_lps[row], top_ids[row] = zip(*top)
    return lp, rank, top_ids, top_lps


def known_logprobs(entry) -> tuple[int, int, int] | None:
    """(start, end, k): the positions [start, end) of the tokens the journal holds for `entry`
    (its prompt, a resumed request's prefix, tokens a pool restart brought back) whose log-probs
    it asks for and the journal does not hold yet (`lp_done`), and how many top ones (the most
    any of them asks for); None if there are none. Position 0 has none. A submission of these
    tokens asks vLLM for `prompt_logprobs=k`; one after the journal holds them asks for none."""
    p = entry.sampling
    start, end = max(1, entry.lp_done), entry.num_tokens
    if p.prompt_logprobs is None:
        start = max(start, entry.prompt_len)
    if p.logprobs is None:
        end = min(end, entry.prompt_len)
    if start >= end:
        return None
    k = max((p.prompt_logprobs or 0) if start < entry.prompt_len else 0,
            (p.logprobs or 0) if end > entry.prompt_len else 0)
    return start, end, k


def known_rows(journal, slot: int, known: tuple[int, int, int], flat) -> tuple:
    """Journal.write_logprobs' arguments for the known positions `known` (`known_logprobs`) of
    the request in `slot`, from vLLM's prompt log-probs `flat` of a submission of the journal's
    tokens (its position i is the row's position i); `lp_done` becomes the range's end."""
    start, end, k = known
    positions = np.arange(start, end, dtype=np.int64)
    tokens = journal.all_tokens(slot, end)[start:end].tolist()
    lp, rank, top_ids, top_lps = rows(flat, positions.tolist(), tokens, k)
    n = end - start
    return (np.full(n, slot, dtype=np.int64), positions, lp, top_ids, top_lps,
            np.full(n, end, dtype=np.uint32), rank)
