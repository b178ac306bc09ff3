"""Sampling: deterministic per (seed, position), correct filtering, batch-independent."""
from dataclasses import dataclass

import torch

from kvhold.executor.sampler import sample, uniform
from kvhold.protocol.sampling import SamplingParams


@dataclass
class S:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    num_generated: int = 0

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)

    def masked_ids(self) -> tuple[int, ...]:
        return ()

    def allowed_ids(self):
        return None


def test_uniform_depends_only_on_seed_and_position():
    assert uniform(1, 5) == uniform(1, 5)
    assert uniform(1, 5) != uniform(1, 6) and uniform(1, 5) != uniform(2, 5)
    values = [uniform(3, i) for i in range(20000)]
    assert 0 <= min(values) and max(values) < 1
    assert abs(sum(values) / len(values) - 0.5) < 0.01


def test_greedy_is_first_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]], dtype=torch.float64)
    assert sample(logits, [S(temperature=0.0)]) == [1]


def test_top_k_one_and_tiny_top_p_are_greedy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g, dtype=torch.float64)
    greedy = logits.argmax(-1).tolist()
    assert sample(logits, [S(top_k=1, seed=i) for i in range(4)]) == greedy
    assert sample(logits, [S(top_p=1e-9, seed=i) for i in range(4)]) == greedy


def test_filters_never_pick_excluded_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    picks = {sample(logits, [S(top_k=2, seed=s)])[0] for s in range(300)}
    assert picks == {0, 1}
    picks = {sample(logits, [S(top_p=0.7, seed=s)])[0] for s in range(300)}
    assert picks == {0, 1}       # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: exactly two kept


def test_frequencies_follow_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    logits = torch.log(probs)[None]
    n = 6000
    counts = torch.zeros(3)
    for i in range(n):
        counts[sample(logits, [S(seed=1234, num_generated=i)])[0]] += 1
    assert torch.allclose(counts / n, probs.float(), atol=0.02)


def test_row_result_does_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 100, generator=g, dtype=torch.float64)
    seqs = [S(temperature=0.9, top_p=0.9, top_k=30, seed=i, num_generated=3 * i) for i in range(6)]
    together = sample(logits, seqs)
    alone = [sample(logits[i:i + 1], [seqs[i]])[0] for i in range(6)]
    assert together == alone
