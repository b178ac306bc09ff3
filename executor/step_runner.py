"""CpuRunner: runs one scheduled step through the model, every sequence in one flat batch.

The reference path (float64 on CPU): all scheduled tokens of all sequences go
through each layer together; attention is computed per sequence over its pages.
Returns the logits of the sequences that sample, in plan order.
"""
from __future__ import annotations

import torch

from executor.kv_cache import KvCache
from executor.llama import LlamaModel, SeqSlice, StepInput


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

    def prepare(self) -> None:
        pass

    def run(self, plan, beat=None) -> torch.Tensor:
        pages, slots, positions, ids = positions_of(plan, self.kv.page_tokens)
        seqs, rows, start = [], [], 0
        for p in plan:
            seqs.append(SeqSlice(start=start, n=p.n, context=p.seq.num_computed + p.n,
                                 pages=torch.tensor(p.seq.pages, device=self.device)))
            start += p.n
            if p.samples:
                rows.append(start - 1)
        dev = self.device
        step = StepInput(token_ids=torch.tensor(ids, device=dev), positions=torch.tensor(positions, device=dev),
                         write_pages=torch.tensor(pages, device=dev), write_slots=torch.tensor(slots, device=dev),
                         seqs=seqs, logits_rows=torch.tensor(rows, device=dev, dtype=torch.long))
        return self.model.forward(step, self.kv)
