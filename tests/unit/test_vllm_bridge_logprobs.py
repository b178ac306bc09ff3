"""The vLLM bridge's log-probs without vLLM (kvhold.vllm_bridge.logprobs): vLLM 0.32's
FlatLogprobs (per position the own token first, with its rank, then the top k) read into the
journal's logprob area; which known tokens a submission asks vLLM's prompt log-probs for; and
the journal round trip through the bridges' token commit, across a resubmission (a takeover)
and a pool restart. Real shared-memory tables (tests.unit.helpers.ShmPool)."""
import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from kvhold.executor.engine_bridge import BridgeWorkload
from kvhold.frontend import logprob_stream
from kvhold.protocol.journal import Journal
from kvhold.protocol.sampling import SamplingParams
from kvhold.vllm_bridge.logprobs import known_logprobs, known_rows, rows
from tests.unit.helpers import mirror_geometry


@dataclasses.dataclass
class Flat:
    """vllm.logprobs.FlatLogprobs' fields, as vLLM 0.32 fills them (append_logprobs_for_next_position)."""
    start_indices: list = dataclasses.field(default_factory=list)
    end_indices: list = dataclasses.field(default_factory=list)
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    ranks: list = dataclasses.field(default_factory=list)

    def append(self, own=None, top=()):
        """`own`: (token, log-prob, rank); `top`: (token, log-prob) in torch.topk's order."""
        self.start_indices.append(len(self.token_ids))
        if own is not None:
            for i, (t, lp, r) in enumerate([own, *((t, lp, i + 1) for i, (t, lp) in enumerate(top))]):
                self.token_ids.append(t)
                self.logprobs.append(lp)
                self.ranks.append(r)
        self.end_indices.append(len(self.token_ids))
        return self

    def __len__(self):
        return len(self.start_indices)


def f32(x):
    return float(np.float32(x))


def test_the_own_token_then_the_top_sorted_by_log_prob_ties_by_lower_id():
    flat = Flat().append((7, f32(-2.5), 4), [(3, f32(-0.5)), (9, f32(-1.25)), (2, f32(-1.25))])
    flat.append((3, f32(-0.75), 1), [(3, f32(-0.75)), (5, f32(-1.0)), (6, f32(-3.0))])
    lp, rank, ids, top = rows(flat, [0, 1], [7, 3], 3)
    assert lp.dtype == np.float32 and rank.dtype == np.int32 and ids.dtype == np.int32
    assert lp.tolist() == [-2.5, -0.75] and rank.tolist() == [4, 1]       # vLLM's rank, as given
    assert ids.tolist() == [[3, 2, 9], [3, 5, 6]]                           # the tie: lower id first
    assert top.tolist() == [[-0.5, -1.25, -1.25], [-0.75, -1.0, -3.0]]
    assert all(np.all(np.diff(r) <= 0) for r in top)
    # fewer top ones than vLLM gave; none (logprobs=0: the own token only)
    _, _, ids2, top2 = rows(flat, [0], [7], 1)
    assert ids2.tolist() == [[3]] and top2.tolist() == [[-0.5]]
    lp0, rank0, ids0, top0 = rows(Flat().append((11, f32(-4.0), 30)), [0], [11], 0)
    assert lp0.tolist() == [-4.0] and rank0.tolist() == [30] and ids0.shape == (1, 0) and top0.shape == (1, 0)


def test_what_is_not_vllms_flat_layout_or_not_the_token_is_refused():
    flat = Flat().append((7, -2.5, 4), [(3, -0.5)])
    with pytest.raises(ValueError, match="not token 8"):
        rows(flat, [0], [8], 1)
    with pytest.raises(ValueError, match="1 top entries, 2 asked for"):
        rows(flat, [0], [7], 2)
    with pytest.raises(ValueError, match="none, not token 7"):
        rows(Flat().append(None), [0], [7], 0)
    with pytest.raises(ValueError, match="flat_logprobs=True"):
        rows([{7: SimpleNamespace(logprob=-2.5, rank=4)}], [0], [7], 0)


def entry(prompt_len, generated, lp_done, **sampling):
    return SimpleNamespace(sampling=SamplingParams(**sampling), prompt_len=prompt_len, lp_done=lp_done,
                           num_tokens=prompt_len + generated)


@pytest.mark.parametrize("e, want", [
    (entry(5, 0, 5, logprobs=3), None),                           # fresh: nothing known to compute
    (entry(5, 0, 1, prompt_logprobs=2), (1, 5, 2)),               # fresh, the prompt's
    (entry(5, 0, 1, prompt_logprobs=2, logprobs=3), (1, 5, 2)),
    (entry(5, 4, 9, prompt_logprobs=2, logprobs=3), None),        # resubmitted: the journal has them
    (entry(5, 4, 5, prompt_logprobs=2), None),                    # generated ones not asked for
    (entry(5, 4, 5, logprobs=3), (5, 9, 3)),                      # a pool restart's tokens
    (entry(5, 4, 1, prompt_logprobs=1, logprobs=3), (1, 9, 3)),   # ... and the prompt's: the widest
    (entry(5, 4, 1, prompt_logprobs=4, logprobs=0), (1, 9, 4)),
    (entry(5, 2, 7, prompt_logprobs=0), None),
])
def test_known_tokens_whose_log_probs_a_submission_asks_vllm_for(e, want):
    assert known_logprobs(e) == want


@pytest.fixture
def pool_geometry():
    return dataclasses.replace(mirror_geometry(), max_logprobs=4)


def bridge(tables):
    w = BridgeWorkload(SimpleNamespace(lease=SimpleNamespace(check=lambda: None)))
    w.journal = Journal(tables)
    return w


def test_log_probs_journaled_with_their_tokens_survive_a_resubmission(pool):
    prompt, slot, rid = [1, 2, 3, 4, 5], 2, 77
    w = bridge(pool.tables)
    j = w.journal
    j.admit(slot, rid, prompt, SamplingParams(max_tokens=8, seed=1, logprobs=3, prompt_logprobs=2))
    j.take(slot, rid, epoch=1)
    e = j.entry(slot)
    known = known_logprobs(e)
    assert known == (1, 5, 2)
    # vLLM's prompt log-probs of the submission (position 0 has none), then the first token's
    plp = Flat().append(None)
    for pos in range(1, 5):
        plp.append((prompt[pos], f32(-1 - pos / 8), 2 + pos), [(40 + pos, f32(-0.25)), (50 + pos, f32(-0.5))])
    j.write_logprobs(*known_rows(j, slot, known, plp))
    assert j.lp_done(slot, rid) == 5
    sampled = Flat()
    for t, lp in [(60, -0.125), (61, -2.0)]:
        sampled.append((t, f32(lp), 1 if t == 60 else 9), [(60, f32(-0.125)), (62, f32(-1.5)), (63, f32(-1.75))])
    for i, t in enumerate([60, 61]):
        e = w._append_token(slot, e, t, rows(sampled, [i], [t], 3))
    assert e.num_generated == 2 and j.lp_done(slot, rid) == 7
    before = logprob_stream.fields(j, slot, len(prompt), 0, 2)
    assert before["logprobs"] == [-0.125, -2.0] and before["ranks"] == [1, 9]
    assert before["top_ids"] == [[60, 62, 63]] * 2
    assert before["prompt_logprobs"] == [f32(-1 - pos / 8) for pos in range(1, 5)]
    assert before["prompt_top_ids"] == [[40 + p, 50 + p] for p in range(1, 5)]
    assert before["prompt_ranks"] == [3, 4, 5, 6]
    assert logprob_stream.sendable(j, slot, rid, len(prompt), 2, False) == 2

    # a takeover resubmits prompt + the 2 tokens: nothing is known to compute again
    e = j.entry(slot)
    assert known_logprobs(e) is None
    again = Flat().append((64, f32(-0.5), 1), [(64, f32(-0.5)), (65, f32(-0.625)), (66, f32(-3.0))])
    e = w._append_token(slot, e, 64, rows(again, [0], [64], 3))
    after = logprob_stream.fields(j, slot, len(prompt), 0, 3)
    assert {k: v[:2] if k in ("logprobs", "ranks", "top_ids", "top_logprobs") else v
            for k, v in after.items()} == before                     # not one bit rewritten
    assert after["logprobs"][2] == -0.5 and after["top_ids"][2] == [64, 65, 66] and j.lp_done(slot, rid) == 8


def test_a_pool_restarts_tokens_have_their_log_probs_computed_again_and_held_back(pool):
    slot, rid, prompt = 1, 90, [1, 2, 3, 4]
    j = Journal(pool.tables)
    j.admit(slot, rid, prompt, SamplingParams(max_tokens=8, seed=1, logprobs=2))
    j.restore_progress(slot, rid, [20, 21, 22])
    e = j.entry(slot)
    assert known_logprobs(e) == (4, 7, 2)
    assert logprob_stream.sendable(j, slot, rid, len(prompt), 3, False) == 0    # held until then
    plp = Flat().append(None)
    for pos, t in enumerate([2, 3, 4, 20, 21, 22], start=1):
        plp.append((t, f32(-pos), pos), [(t, f32(-pos)), (99, f32(-pos - 1))])
    j.write_logprobs(*known_rows(j, slot, (4, 7, 2), plp))
    assert j.lp_done(slot, rid) == 7 and logprob_stream.sendable(j, slot, rid, len(prompt), 3, False) == 3
    assert logprob_stream.fields(j, slot, len(prompt), 0, 3)["logprobs"] == [-4.0, -5.0, -6.0]
    assert known_logprobs(j.entry(slot)) is None
