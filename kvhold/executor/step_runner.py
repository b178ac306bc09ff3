"""CpuRunner: runs one scheduled step through the model, every sequence in one flat batch.

The reference path (float64 on CPU): all scheduled tokens of all sequences go
through each layer together; attention is computed per sequence over its pages.
Returns the logits of the sequences that sample, in plan order; `run_and_sample`
also picks the tokens and hashes the slots decode rows wrote, for the commit. A step that
reports log-probs of known tokens (`logprob_rows`) gets the logits of those rows too
(`extra_logits`); the sampling rows' logits stay in `sample_logits` until the next step.
"""
from __future__ import annotations

import time

import torch

from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput
from kvhold.executor.sampler import sample
from kvhold.protocol.checksum import TorchChecksum


def positions_of(plan, page_tokens: int):
    """(pages, slots, positions, token ids) of every token the plan computes, in plan order."""
    pages, slots, positions, ids = [], [], [], []
    for p in plan:
        s = p.seq
        pos = range(s.num_computed, s.num_computed + p.n)
        ids.extend(s.tokens[s.num_computed:s.num_computed + p.n])
        positions.extend(pos)
        pages.extend(s.pages[i // page_tokens] for i in pos)
        slots.extend(i % page_tokens for i in pos)
    return pages, slots, positions, ids


class CpuRunner:
    def __init__(self, model: LlamaModel, kv: KvCache):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.hasher = TorchChecksum(kv.pool)
        self.queued_ns = 0

    def prepare(self) -> None:
        pass

    def run(self, plan, beat=None, logprob_rows=()) -> torch.Tensor:
        """Logits of the sampling rows, in plan order, then of `logprob_rows` ((plan index, KV
        position) pairs, in their order)."""
        pages, slots, positions, ids = positions_of(plan, self.kv.page_tokens)
        seqs, rows, start = [], [], 0
        starts = []
        for p in plan:
            starts.append(start)
            seqs.append(SeqSlice(start=start, n=p.n, context=p.seq.num_computed + p.n,
                                 pages=torch.tensor(p.seq.pages, device=self.device)))
            start += p.n
            if p.samples:
                rows.append(start - 1)
        rows += [starts[i] + pos - plan[i].seq.num_computed for i, pos in logprob_rows]
        dev = self.device
        step = StepInput(token_ids=torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
                         write_pages=torch.tensor(pages, device=dev), write_slots=torch.tensor(slots, device=dev),
                         seqs=seqs, logits_rows=torch.tensor(rows, device=dev, dtype=torch.long))
        return self.model.forward(step, self.kv)

    def run_and_sample(self, plan, sampling, beat=None, after_forward=None,
                       logprob_rows=()) -> tuple[list[int], dict[int, int]]:
        """Run the step and pick its tokens; returns (tokens of `sampling`, and for a decode-only
        step {page: hash of the one slot each row wrote there}), as kvhold.executor.cuda.runner does."""
        logits = self.run(plan, beat, logprob_rows)
        logits, self.extra_logits = logits[:len(sampling)], logits[len(sampling):]
        self.sample_logits = logits
        self.queued_ns = time.monotonic_ns()
        if after_forward is not None:
            after_forward(plan)
        tokens = sample(logits, sampling) if sampling else []
        if not plan or any(p.n != 1 for p in plan):      # only decode steps, as on a GPU
            return tokens, {}
        pt = self.kv.page_tokens
        pages = [p.seq.pages[p.seq.num_computed // pt] for p in plan]
        slots = [p.seq.num_computed % pt for p in plan]
        hashes = self.hasher.slots(torch.tensor(pages), torch.tensor(slots)).tolist()
        return tokens, dict(zip(pages, hashes))
