"""CudaRunner: one scheduled step on a GPU, shaped so that results do not depend on
what else is in the batch.

* Decode tokens (one new token per sequence) run as one batch padded to exactly
  `max_batch` rows, every step: every GEMM sees the same shape, so each row's
  arithmetic is the same whatever the other rows hold, and the whole decode
  forward is captured once as a CUDA graph against the shared pool's stable
  addresses and replayed. Attention reads pages in place (executor.cuda_attention).
* Prefill chunks run one sequence at a time, padded to exactly `prefill_chunk`
  rows, chunk boundaries at fixed positions (the scheduler keeps them aligned).
Padding rows write their keys/values into the reserved null page 0 and are ignored.
The graph is captured by a standby during warm-up; capture runs no kernel. An
executor forked to take over at once (no standby was ready) defers the capture
to a later step and decodes eagerly until then: the same kernels, bit-identical.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from executor.cuda_attention import paged_decode_attention
from executor.kv_cache import KvCache
from executor.llama import LlamaModel
from executor.page_allocator import NULL_PAGE
from executor.step_runner import positions_of

log = logging.getLogger(__name__)


class CudaRunner:
    def __init__(self, model: LlamaModel, kv: KvCache, max_batch: int, prefill_chunk: int,
                 max_pages_per_seq: int, use_graph: bool = True):
        self.model, self.kv = model, kv
        self.device = model.device
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.use_graph = use_graph
        dev, b = self.device, max_batch
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.pages = torch.full((b,), NULL_PAGE, dtype=torch.long, device=dev)
        self.slots = torch.zeros(b, dtype=torch.long, device=dev)
        self.table = torch.full((b, max_pages_per_seq), NULL_PAGE, dtype=torch.int32, device=dev)
        self.ctx = torch.ones(b, dtype=torch.int32, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_logits: torch.Tensor | None = None
        self._capture_failed = False
        self.scale = model.spec.head_dim ** -0.5

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def _decode_forward(self) -> torch.Tensor:
        h = self.model.layers(self.ids, self.positions, self.pages, self.slots, self.kv,
                              lambda layer, q: paged_decode_attention(q, self.kv.pool, layer, self.table,
                                                                      self.ctx, self.scale))
        return self.model.logits(h)

    def _reset_padding(self) -> None:
        self.ids.zero_()
        self.positions.zero_()
        self.pages.fill_(NULL_PAGE)
        self.slots.zero_()
        self.table.fill_(NULL_PAGE)
        self.ctx.fill_(1)

    def prepare(self, urgent: bool = False) -> dict[str, float]:
        """Load every kernel a step uses, size the allocator and capture the decode graph;
        returns the parts' times in ms. All rows are padding: only the reserved null page is
        written. An urgent executor (it takes over as soon as it is ready, and its first step
        is decode-only) warms the decode path only: prefill kernels load on its first prefill
        and the graph is captured a few steps later (see `capture`)."""
        times, t0 = {}, time.monotonic()

        def lap(name):
            nonlocal t0
            torch.cuda.synchronize()
            times[name] = round((time.monotonic() - t0) * 1e3, 2)
            t0 = time.monotonic()

        self._reset_padding()
        for _ in range(1 if urgent else 2):
            self._decode_forward()
        lap("decode_warm_up")
        if not urgent:
            self._prefill(self._padding_chunk())
            lap("prefill_warm_up")
            self.capture()
            lap("graph_capture")
        return times

    @property
    def capture_pending(self) -> bool:
        return self.use_graph and self.graph is None and not self._capture_failed

    def capture(self) -> None:
        """Capture the decode forward as a graph. Safe between steps of an active executor:
        the warm-up pass writes only the null page and capture itself runs no kernel."""
        if not self.capture_pending:
            return
        self._reset_padding()
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._decode_forward()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.graph_logits = self._decode_forward()
            torch.cuda.synchronize()
            self.graph = graph
        except Exception as exc:  # capture is an optimisation: eager decode is correct
            log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self._capture_failed = True
            self.graph = None

    def _decode(self, items) -> torch.Tensor:
        n = len(items)
        pt = self.kv.page_tokens
        pages, slots, positions, ids = positions_of(items, pt)
        self._reset_padding()
        dev = self.device
        self.ids[:n] = torch.tensor(ids, device=dev)
        self.positions[:n] = torch.tensor(positions, device=dev)
        self.pages[:n] = torch.tensor(pages, device=dev)
        self.slots[:n] = torch.tensor(slots, device=dev)
        width = self.table.shape[1]
        rows = [p.seq.pages + [NULL_PAGE] * (width - len(p.seq.pages)) for p in items]
        self.table[:n] = torch.tensor(rows, dtype=torch.int32, device=dev)
        self.ctx[:n] = torch.tensor([pos + 1 for pos in positions], dtype=torch.int32, device=dev)
        if self.graph is not None:
            self.graph.replay()
            return self.graph_logits[:n]
        return self._decode_forward()[:n]

    def _padding_chunk(self):
        from executor.scheduler import Scheduled
        from executor.sequence import Sequence

        n, pt = self.prefill_chunk, self.kv.page_tokens
        seq = Sequence(slot=-1, request_id=0, prompt_len=n, tokens=[0] * n, max_tokens=1, seed=0,
                       temperature=0.0, top_p=1.0, top_k=0, stop_ids=frozenset(), ignore_eos=True,
                       pages=[NULL_PAGE] * -(-n // pt))
        return Scheduled(seq, n)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def _prefill(self, item) -> torch.Tensor:
        seq, n, c = item.seq, item.n, self.prefill_chunk
        pt = self.kv.page_tokens
        pages, slots, positions, ids = positions_of([item], pt)
        pad = c - n
        dev = self.device
        ids_t = torch.tensor(ids + [0] * pad, device=dev)
        pos_t = torch.tensor(positions + [0] * pad, device=dev)
        pages_t = torch.tensor(pages + [NULL_PAGE] * pad, device=dev)
        slots_t = torch.tensor(slots + [0] * pad, device=dev)
        context = seq.num_computed + n
        seq_pages = torch.tensor(seq.pages, device=dev)
        first = seq.num_computed
        key_pos = torch.arange(context, device=dev)
        query_pos = first + torch.arange(c, device=dev)
        mask = (key_pos[None, :] <= query_pos[:, None]) | (torch.arange(c, device=dev) >= n)[:, None]
        group = self.model.group

        def attend(layer, q):
            k, v = self.kv.gather(layer, seq_pages, context, q.dtype)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], attn_mask=mask[None, None])
            return out[0].transpose(0, 1)

        h = self.model.layers(ids_t, pos_t, pages_t, slots_t, self.kv, attend)
        return self.model.logits(h[n - 1:n])

    # ------------------------------------------------------------------ step
    def run(self, plan, beat=None) -> torch.Tensor:
        decode = [p for p in plan if p.n == 1]
        prefill = [p for p in plan if p.n > 1]
        if len(decode) > self.max_batch:
            raise RuntimeError(f"{len(decode)} decode rows exceed the batch of {self.max_batch}")
        logits = {}
        if decode:
            out = self._decode(decode)
            for i, p in enumerate(decode):
                logits[id(p)] = out[i]
        for p in prefill:
            if p.n > self.prefill_chunk:
                raise RuntimeError(f"a prefill chunk of {p.n} exceeds {self.prefill_chunk}")
            out = self._prefill(p)
            logits[id(p)] = out[0]
            if beat is not None:
                beat()             # a step of many chunks is progress, not a hang
        rows = [logits[id(p)] for p in plan if p.samples]
        return torch.stack(rows) if rows else torch.empty(0, device=self.device)
