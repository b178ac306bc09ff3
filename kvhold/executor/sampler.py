"""Deterministic sampling: greedy, temperature, top-k, top-p, one batched pass.

The random draw for request r at generated position i is u(seed_r, i), a
counter-based hash (splitmix64) turned into a float in [0, 1): it depends only on
the request's seed and the position, never on batch composition, step count or
which executor runs the step. Given the same logits, a resumed request therefore
picks exactly the token an uninterrupted run would have picked. The choice is an
inverse-CDF lookup over tokens sorted by (probability desc, id asc) with a stable
sort, so ties break the same way everywhere.

Each row reads its parameters from its sequence's `sampling` (kvhold.protocol.sampling). A
request with `min_tokens` cannot end before that many generated tokens: until then the
tokens that would end it (`Sequence.masked_ids`: its stop ids, and EOS unless ignore_eos)
get a logit of -inf, for greedy and sampled rows alike. The mask depends only on the
request and the position, so a recomputation after a takeover picks the same tokens.

Penalties are vLLM's, on the logits before temperature, for greedy and sampled rows alike:
`repetition_penalty` r divides a positive logit by r and multiplies a negative one by r for
every token in the prompt or generated so far; `frequency_penalty` f and `presence_penalty` p
subtract f x (times the token was generated) + p x (1 if it was) . Then `min_p` (after
temperature, before top-k and top-p) drops the tokens less likely than min_p times the most
likely one. Each is a function of the request's tokens (the journal's: prompt and committed
generated ones) and its params, per row, so a resumed request is penalized exactly as it
would have been uninterrupted.

`logit_bias` (OpenAI's) is added to the raw logits first, before any of these.
Structured output (kvhold.executor.grammar) comes last: each constrained row keeps only the
tokens its grammar allows after its generated tokens, for greedy and sampled rows alike.
"""
from __future__ import annotations

import torch

from kvhold.protocol.sampling import SamplingParams

_M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """u in [0, 1) for (seed, position), with 53 random bits."""
    return (splitmix64(splitmix64(seed) ^ position) >> 11) / float(1 << 53)


def sample(logits: torch.Tensor, seqs, pad_rows: int = 0) -> list[int]:
    """One token per row of `logits` [B, V] for the matching sequences.

    `pad_rows`: on a GPU, how the reductions over the vocabulary (sums, prefix sums) split
    their work, and so how they round, depends on how many rows are reduced together. Rows
    that sample with a temperature are therefore sampled in groups of exactly `pad_rows` rows
    (the runner's batch; the last group padded), so a row's token never depends on how many
    others sample beside it."""
    if logits.device.type == "cpu":
        logits = logits.to(torch.float64)
    else:
        logits = logits.float()
    logits = _constrain(_penalize(_mask(_bias(logits, seqs), seqs), seqs), logits, seqs)
    tokens = torch.argmax(logits, dim=-1)              # greedy rows, first maximum wins
    rows = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
    if rows and (logits.device.type == "cpu" or pad_rows <= 0):
        tokens[rows] = _sample_rows(logits[rows], [seqs[i] for i in rows])
    elif rows:                  # groups of exactly pad_rows rows, the last one padded
        for start in range(0, len(rows), pad_rows):
            group = rows[start:start + pad_rows]
            hot = logits[group]
            if len(group) < pad_rows:
                hot = torch.cat([hot, hot.new_zeros(pad_rows - len(group), hot.shape[1])])
            picked = _sample_rows(hot, [seqs[i] for i in group] + [_PAD] * (pad_rows - len(group)))
            tokens[group] = picked[:len(group)]
    return tokens.tolist()


def _bias(logits: torch.Tensor, seqs) -> torch.Tensor:
    """`logits` with each row's `logit_bias` added (a copy when any row has one): OpenAI's, the
    first change to the logits."""
    biased = [(i, s.sampling.logit_bias) for i, s in enumerate(seqs) if s.sampling.logit_bias]
    if not biased:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    rows = [i for i, pairs in biased for t, _ in pairs if t < vocab]
    cols = [t for _, pairs in biased for t, _ in pairs if t < vocab]
    add = torch.tensor([b for _, pairs in biased for t, b in pairs if t < vocab], dtype=logits.dtype,
                       device=logits.device)
    logits[rows, cols] += add
    return logits


def _mask(logits: torch.Tensor, seqs) -> torch.Tensor:
    """`logits` with each row's `masked_ids()` at -inf (a copy when any is: the caller's
    logits, a CUDA graph's buffer or the log-probs' raw distribution, stay as they are)."""
    masked = [(i, ids) for i, s in enumerate(seqs) if (ids := s.masked_ids())]
    if not masked:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    rows = [i for i, ids in masked for t in ids if t < vocab]
    cols = [t for _, ids in masked for t in ids if t < vocab]
    logits[rows, cols] = float("-inf")
    return logits


def _constrain(logits: torch.Tensor, raw: torch.Tensor, seqs) -> torch.Tensor:
    """`logits` with the tokens each constrained row's grammar does not allow at -inf (a copy
    when any row is constrained). The grammar wins over min_tokens: when it allows only what
    min_tokens masks (EOS, once the output is complete), those come from `raw`, the logits
    before the masks."""
    rows = [(i, allowed) for i, s in enumerate(seqs) if (allowed := s.allowed_ids()) is not None]
    if not rows:
        return logits
    logits = logits.clone()
    for i, allowed in rows:
        keep = torch.from_numpy(allowed[:logits.shape[-1]]).to(logits.device)
        row = logits[i].masked_fill(~keep, float("-inf"))
        if not torch.isfinite(row).any():
            row = raw[i].masked_fill(~keep, float("-inf"))
        if torch.isfinite(row).any():          # a model without EOS keeps its row as it was
            logits[i] = row
    return logits


def _penalize(logits: torch.Tensor, seqs) -> torch.Tensor:
    """`logits` with each penalized row's penalties applied (a copy when any row is)."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, dev = logits.shape[-1], logits.device
    for i in rows:
        s, p = seqs[i], seqs[i].sampling
        tokens = torch.tensor(s.tokens, dtype=torch.long, device=dev)
        tokens = tokens[tokens < vocab]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.unique(tokens)
            x = row[seen]
            row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if p.frequency_penalty or p.presence_penalty:
            generated = torch.tensor(s.tokens[s.prompt_len:], dtype=torch.long, device=dev)
            counts = torch.bincount(generated[generated < vocab], minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return logits


class _Pad:
    """A padding row (its token is discarded)."""
    sampling = SamplingParams(temperature=1.0, seed=0)
    num_generated = 0

    def allowed_ids(self):
        return None


_PAD = _Pad()


def _sample_rows(logits: torch.Tensor, seqs) -> torch.Tensor:
    """One token per row, drawn with its sequence's `sampling` at its `num_generated`."""
    dev, vocab = logits.device, logits.shape[-1]
    params = [s.sampling for s in seqs]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev)
    u = torch.tensor([uniform(p.seed, s.num_generated) for p, s in zip(params, seqs)], dtype=logits.dtype,
                     device=dev)

    scaled = logits / temps[:, None]
    if any(p.min_p > 0 for p in params):   # p_i < min_p x p_max, as logits: below max + log(min_p)
        min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=dev)
        floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=dev)
    sorted_logits = sorted_logits.masked_fill((top_k[:, None] > 0) & (rank >= top_k[:, None]), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs          # mass of strictly more likely tokens
    drop = before >= top_p[:, None]
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    cdf = torch.cumsum(probs, dim=-1)
    kept = (probs > 0).sum(dim=-1)
    choice = torch.searchsorted(cdf, u[:, None], right=True).squeeze(1)
    choice = torch.minimum(choice, kept - 1)              # rounding can leave cdf[-1] < u
    return order.gather(1, choice[:, None]).squeeze(1)


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int, pad_rows: int = 0, with_rank: bool = False):
    """Log-probabilities of the model's raw distribution, as vLLM reports them by default
    (`logprobs_mode` raw_logprobs: log_softmax of the logits, before temperature, top-k or top-p):
    for each row of `logits` [R, V] the log-prob of `targets[i]`, and the ids and log-probs of
    its `k` most likely tokens, most likely first, ties broken by lower id (a stable sort).
    Computed in float64 on CPU, float32 on a GPU; returned as float32/int32 numpy arrays
    ([R], [R, k], [R, k]), what the journal's logprob area holds. `pad_rows`: as for `sample`,
    on a GPU the softmax's reduction rounds by how many rows it reduces together, so rows go in
    groups of exactly `pad_rows` (the last one padded): a row's log-probs never depend on how
    many others are computed beside it (requests sampling in the same step). `with_rank`: also
    each target's rank (1 + the tokens strictly more likely, vLLM's), second of four arrays."""
    x = logits.to(torch.float64) if logits.device.type == "cpu" else logits.float()
    if x.device.type == "cpu" or pad_rows <= 0:
        lp = torch.log_softmax(x, dim=-1)
    else:
        rows = x.shape[0]
        groups = -(-rows // pad_rows)
        padded = torch.cat([x, x.new_zeros(groups * pad_rows - rows, x.shape[1])])
        lp = torch.cat([torch.log_softmax(padded[g * pad_rows:(g + 1) * pad_rows], dim=-1)
                        for g in range(groups)])[:rows]
    idx = torch.tensor(targets, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None]).squeeze(1)
    rank = (lp > chosen[:, None]).sum(dim=-1) + 1 if with_rank else None
    if k:
        vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
        vals, ids = vals[:, :k], ids[:, :k]
    else:
        vals = lp.new_zeros(len(targets), 0)
        ids = idx.new_zeros(len(targets), 0)
    out = (chosen.float().cpu().numpy(), ids.to(torch.int32).cpu().numpy(), vals.float().cpu().numpy())
    if with_rank:
        return out[0], rank.to(torch.int32).cpu().numpy(), out[1], out[2]
    return out
