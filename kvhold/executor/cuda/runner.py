"""CudaRunner: one scheduled step on a GPU, shaped so that results do not depend on
what else is in the batch.

* Decode tokens (one new token per sequence) run as one batch padded to a bucket of
  rows (16, 32, 64, 128, 256 up to `max_batch`; kvhold.executor.cuda.gemm.decode_buckets), each bucket's
  forward captured once as a CUDA graph against the shared pool's stable addresses and
  replayed. Every kernel of the step computes a row the same way at every bucket (the
  projections run on kvhold.executor.cuda.gemm's kernel), so each row's arithmetic is the same
  whatever the other rows hold; a bucket of more than 64 rows runs them on the kernel's
  `exact_linear` tiles, the same bits. Where that kernel does not apply (no fused layers, fp32,
  projection biases, more than 256 rows) there is one bucket, `max_batch`, and the same
  holds because every GEMM always sees the same shape. Attention reads pages in place
  (kvhold.executor.cuda.attention).
* Exact prefill (`exact`, on by default; ExecutorSettings.exact_prefill, `--no-exact-prefill` turns it off): a prefill chunk's
  rows are computed by the decode step's kernels, so a position's KV and logits are the
  same bits whether a single prefill, chunked prefill (any chunk sizes, any batch) or a
  decode step computed it, and a request recomputed after a preemption, a damaged page
  or a pool restart continues exactly as an uninterrupted run:
  - the projections on kvhold.executor.cuda.gemm's kernel at any row count
    (`exact_linear`: the decode's tiles up to 64 rows, bigger tiles beyond, the same
    k16 accumulation order over K per output element; no cuBLAS, whose split-K and
    tile choice depend on the shape);
  - RoPE and the KV store on the decode kernel, attention on the decode kernel's
    arithmetic (cuda_attention.rope_prefill_attention: each position attends over its
    own context in the decode's 64-position blocks, dot shapes and online softmax,
    one position per program, or several packed into the tile rows a decode step pads;
    no SDPA, whose reduction order depends on how many queries share a tile);
  - RMSNorm, SiLU-times-up and the residual adds by the same per-row kernels as decode,
    and the last row's logits on the decode's logits GEMM.
  No padding: no kernel's arithmetic for a row depends on the number of rows. Where the
  decode step is not on the batch-invariant kernels (fp32, projection biases, more than
  256 rows, KVHOLD_FUSED=0 or KVHOLD_SKINNY_GEMM=0) exact prefill is unavailable: the
  runner says why (`exact_refusal`, logged) and prefills as below.
* Otherwise (exact off) prefill chunks run one sequence at a time, padded to exactly `prefill_chunk`
  rows, chunk boundaries at fixed positions (the scheduler keeps them aligned). Their
  attention's keys are padded (zeros, masked) to a multiple of the chunk, so there are
  only max_seq_len / prefill_chunk attention shapes, and warm-up runs each once. The
  attention runs on PyTorch's memory-efficient kernel, not cuDNN (torch's default on the
  H200): cuDNN's first call took 1.6 s and each new key length 50-70 ms to build a plan
  (tools/probe_prefill_attention, bench/results/prefill_attention_cuda.json), enough for
  an executor's first prefills to miss heartbeats and be fenced for a hang; the
  memory-efficient kernel took 38 ms once, then 0.2 ms at any new length.
Padding rows write their keys/values into the reserved null page 0 and are ignored.
The graphs are captured by a standby during warm-up; capture runs no kernel. An
executor forked to take over at once (no standby was ready) defers the capture
to a later step and decodes eagerly until then: the same kernels, bit-identical.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvhold.executor import faults
from kvhold.executor.cuda import gemm as cuda_gemm
from kvhold.executor.cuda.attention import (paged_decode_attention, prefill_launch_key, rope_decode_attention,
                                             rope_prefill_attention)
from kvhold.executor.cuda.checksum import TritonChecksum
from kvhold.executor.cuda.gemm import decode_buckets
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel
from kvhold.executor.page_allocator import NULL_PAGE
from kvhold.executor.sampler import sample
from kvhold.executor.step_runner import positions_of

log = logging.getLogger(__name__)
PREFILL_ATTENTION = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]     # not cuDNN: see the docstring


def exact_warm_up_rows(chunk: int, shapes) -> list[int]:
    """The chunk sizes a standby's warm-up prefills (exact prefill), largest first: one for each
    combination of compiled kernels that a chunk of 2..`chunk` rows launches, the projections'
    (`shapes`, (N, K) pairs; kvhold.executor.cuda.gemm.exact_launch_key) and the attention's
    (kvhold.executor.cuda.attention.prefill_launch_key). A kernel first launched in a step would
    compile there, for about a second: longer than the lease."""
    return cuda_gemm.rows_per_key(chunk, lambda m: (tuple(cuda_gemm.exact_launch_key(n, k, m) for n, k in shapes),
                                                    prefill_launch_key(m)))


def warm_up_logits(model, device) -> list[int]:
    """The logits of a prefill chunk's prompt log-prob rows, once per compiled kernel they can
    launch (kvhold.executor.cuda.gemm.logits_warm_up_rows); returns the row counts run."""
    rows = cuda_gemm.logits_warm_up_rows(model.lm_head.shape[0], model.spec.hidden_size)
    with torch.inference_mode():
        for m in rows:
            model.logits(torch.zeros((m, model.spec.hidden_size), dtype=model.dtype, device=device))
    return rows


class CudaRunner:
    def __init__(self, model: LlamaModel, kv: KvCache, max_batch: int, prefill_chunk: int,
                 max_pages_per_seq: int, use_graph: bool = True, slot_hashes: bool = True,
                 exact: bool = False):
        self.model, self.kv = model, kv
        self.device = model.device
        self.max_batch = max_batch
        fused = model.fused
        # exact prefill: every prefill row computed as a decode step computes it (module docstring)
        self.exact_refusal = (("no fused layers (KVHOLD_FUSED=0)" if fused is None else fused.exact_prefill(max_batch))
                              if exact else None)
        self.exact = exact and self.exact_refusal is None
        if self.exact_refusal is not None:
            log.warning("exact prefill unavailable, prefill on cuBLAS and SDPA (a recomputed request may "
                        "differ from an uninterrupted run where bf16 rounding tips a near-tie): %s",
                        self.exact_refusal)
        self.invariant = fused is not None and fused.batch_invariant(max_batch)
        self.buckets = decode_buckets(max_batch) if self.invariant else [max_batch]
        self.prefill_chunk = prefill_chunk
        self.max_seq_len = min(max_pages_per_seq * kv.page_tokens, model.cos.shape[0])
        self.use_graph = use_graph
        dev, b = self.device, max_batch
        # A decode step's inputs, staged in pinned host memory and sent in two copies:
        # int64 rows ids | positions | pages | slots, and int32 ctx then the block table.
        self._host64 = torch.empty((4, b), dtype=torch.long, pin_memory=True)
        self._host32 = torch.empty(b * (1 + max_pages_per_seq), dtype=torch.int32, pin_memory=True)
        self._np64 = self._host64.numpy()
        self._np_ctx, self._np_table = self._host32[:b].numpy(), self._host32[b:].view(b, -1).numpy()
        self._in64 = torch.empty_like(self._host64, device=dev)
        self._in32 = torch.empty_like(self._host32, device=dev)
        self.ids, self.positions, self.pages, self.slots = self._in64.unbind(0)
        self.ctx = self._in32[:b]
        self.table = self._in32[b:].view(b, max_pages_per_seq)
        self._staged = torch.cuda.Event()      # the host buffers may be rewritten once it is reached
        # The commit's checksums of the slots a decode step writes, computed inside the step
        # (graph) right after the forward: the commit then reads them back with the tokens.
        self.hasher = TritonChecksum(kv.pool) if slot_hashes else None
        # bucket -> (graph, its logits [bucket, vocab], its out [2, bucket])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._capture_failed = False
        self.scale = model.spec.head_dim ** -0.5
        self.queued_ns = 0

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def _decode_forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `rows` staged rows: logits [rows, vocab] and out [2, rows] int64, each
        row's greedy token and the hash of the KV slot it wrote (zeros without slot hashes)."""
        pages, slots, table, ctx = self.pages[:rows], self.slots[:rows], self.table[:rows], self.ctx[:rows]
        model, pool, positions = self.model, self.kv.pool, self.positions[:rows]
        # past the decode tiles' rows, a batch-invariant step runs on exact_linear's tiles (same bits)
        big = self.invariant and rows > cuda_gemm.MAX_ROWS
        if model.fused is not None:         # RoPE and the KV store inside the attention kernel
            spec = model.spec
            h = model.fused.layers(self.ids[:rows], positions, pages, slots, self.kv, None, lambda layer, qkv:
                                   rope_decode_attention(qkv, model.cos, model.sin, positions, pages, slots, pool,
                                                         layer, table, ctx, self.scale, spec.num_heads,
                                                         spec.num_kv_heads), exact=big)
        else:
            h = model.layers(self.ids[:rows], positions, pages, slots, self.kv,
                             lambda layer, q: paged_decode_attention(q, pool, layer, table, ctx, self.scale))
        logits = self.model.logits(h, exact=big)
        greedy = torch.argmax(logits, dim=-1)       # the sampler's greedy rule: first maximum wins
        hashes = (self.hasher.slots(pages, slots) if self.hasher is not None
                  else torch.zeros_like(greedy))
        return logits, torch.stack([greedy, hashes])

    def _stage(self, items) -> None:
        """Write the decode inputs (real rows, then padding) to the device: two copies."""
        n = len(items)
        pages, slots, positions, ids = positions_of(items, self.kv.page_tokens)
        self._staged.synchronize()             # the previous step's copies have left these buffers
        h64, ctx, table = self._np64, self._np_ctx, self._np_table
        h64[:, n:] = ((0,), (0,), (NULL_PAGE,), (0,))
        h64[0, :n], h64[1, :n], h64[2, :n], h64[3, :n] = ids, positions, pages, slots
        ctx[:] = 1
        ctx[:n] = positions
        ctx[:n] += 1
        table[:] = NULL_PAGE
        for i, p in enumerate(items):
            table[i, :len(p.seq.pages)] = p.seq.pages
        self._in64.copy_(self._host64, non_blocking=True)
        self._in32.copy_(self._host32, non_blocking=True)
        self._staged.record()

    def _reset_padding(self) -> None:
        self._stage([])

    def prepare(self, urgent: bool = False) -> dict[str, float]:
        """Load every kernel a step uses, size the allocator and capture the decode graph;
        returns the parts' times in ms. All rows are padding: only the reserved null page is
        written. An urgent executor (it takes over as soon as it is ready, and its first step
        is decode-only) warms the decode path only, at its largest bucket (a zygote's spare has
        loaded every bucket's kernels; without one a smaller bucket's load on its first use):
        prefill kernels load on its first prefill and the graph is captured a few steps later
        (see `capture`)."""
        times, t0 = {}, time.monotonic()

        def lap(name):
            nonlocal t0
            torch.cuda.synchronize()
            times[name] = round((time.monotonic() - t0) * 1e3, 2)
            t0 = time.monotonic()

        self._reset_padding()
        for _ in range(1 if urgent else 2):     # urgent: the largest bucket sizes the allocator for all
            for rows in (self.buckets[-1:] if urgent else self.buckets):
                self._decode_forward(rows)
        lap("decode_warm_up")
        if not urgent:
            warm_up_logits(self.model, self.device)
            lap("logits_warm_up")
        if not urgent and self.exact:
            c = min(self.prefill_chunk, self.max_seq_len)     # each kernel a chunk can launch, once
            for n in exact_warm_up_rows(c, self.model.fused.projection_shapes()):
                self._prefill(self._padding_chunk(c, n))
            lap("prefill_warm_up")
        elif not urgent:
            for keys in range(self.prefill_chunk, self.max_seq_len + self.prefill_chunk, self.prefill_chunk):
                self._prefill(self._padding_chunk(max(self.prefill_chunk, min(keys, self.max_seq_len))))
            lap("prefill_warm_up")
        if not urgent:
            self.capture()
            lap("graph_capture")
        return times

    @property
    def capture_pending(self) -> bool:
        return self.use_graph and not self.graphs and not self._capture_failed

    def capture(self) -> None:
        """Capture each bucket's decode forward as a graph (largest first, one memory pool),
        and launch each once. Safe between steps of an active executor: the warm-up passes
        and those launches see padding rows only (they write only the null page), and
        capture itself runs no kernel."""
        if not self.capture_pending:
            return
        self._reset_padding()
        graphs = {}
        try:
            pool = torch.cuda.graph_pool_handle()
            for rows in sorted(self.buckets, reverse=True):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._decode_forward(rows)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits, out = self._decode_forward(rows)
                graph.replay()      # the first launch uploads the graph: not in a takeover's first step
                graphs[rows] = (graph, logits, out)
            torch.cuda.synchronize()
            self.graphs = graphs
        except Exception as exc:  # capture is an optimisation: eager decode is correct
            log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self._capture_failed = True
            self.graphs = {}

    def bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _decode(self, items) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(items)
        self._stage(items)
        rows = self.bucket(n)
        if rows in self.graphs:
            graph, logits, out = self.graphs[rows]
            graph.replay()
        else:
            logits, out = self._decode_forward(rows)
        self.queued_ns = time.monotonic_ns()
        return logits[:n], out[:, :n]

    def _padding_chunk(self, context: int, n: int = 0):
        """The last chunk (`n` tokens, default prefill_chunk) of a `context`-token prompt, all
        on the null page."""
        from kvhold.executor.scheduler import Scheduled
        from kvhold.executor.sequence import Sequence
        from kvhold.protocol.sampling import SamplingParams

        n, pt = n or self.prefill_chunk, self.kv.page_tokens
        seq = Sequence(slot=-1, request_id=0, prompt_len=context, tokens=[0] * context,
                       sampling=SamplingParams(max_tokens=1, temperature=0.0, seed=0, ignore_eos=True),
                       num_computed=context - n, pages=[NULL_PAGE] * -(-context // pt))
        return Scheduled(seq, n)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def _prefill(self, item, rows=()) -> torch.Tensor:
        """Logits of the chunk's rows at KV positions `rows`, then of its last row; its keys and
        values go to the pool."""
        if self.exact:
            return self._prefill_exact(item, rows)
        return self._prefill_fast(item, rows)

    def _prefill_exact(self, item, rows=()) -> torch.Tensor:
        """The chunk's rows exactly as decode steps compute them (module docstring): the
        projections on kvhold.executor.cuda.gemm.exact_linear, RoPE + KV store + attention on
        the decode kernel with one row per position (rope_prefill_attention), the logits of
        the last row on the decode's logits GEMM. No padding: no kernel's per-row
        arithmetic depends on the number of rows."""
        seq, n = item.seq, item.n
        model, spec, dev = self.model, self.model.spec, self.device
        pages, slots, positions, ids = positions_of([item], self.kv.page_tokens)
        rows64 = torch.tensor([ids, positions, pages, slots], dtype=torch.long).to(dev, non_blocking=True)
        ids_t, pos_t, pages_t, slots_t = rows64.unbind(0)
        rows32 = torch.tensor([p + 1 for p in positions] + [0] * n + list(seq.pages),
                              dtype=torch.int32).to(dev, non_blocking=True)
        ctx, no_ctx = rows32[:n], rows32[n:2 * n]
        table = rows32[2 * n:][None, :].expand(n, -1)     # every row: the sequence's pages
        pool = self.kv.pool
        h = model.fused.layers(
            ids_t, pos_t, pages_t, slots_t, self.kv, None,
            lambda layer, qkv: rope_prefill_attention(qkv, model.cos, model.sin, pos_t, pages_t, slots_t, pool,
                                                      layer, table, ctx, no_ctx, self.scale, spec.num_heads,
                                                      spec.num_kv_heads),
            exact=True)
        if not rows:
            return model.logits(h[n - 1:n])
        picked = [pos - seq.num_computed for pos in rows] + [n - 1]
        return model.logits(h[torch.tensor(picked, device=dev)])

    def _prefill_fast(self, item, rows=()) -> torch.Tensor:
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
        keys = -(-context // c) * c            # padded: one attention shape per chunk index
        seq_pages = torch.tensor(seq.pages, device=dev)
        first = seq.num_computed
        key_pos = torch.arange(keys, device=dev)
        query_pos = first + torch.arange(c, device=dev)
        mask = (key_pos[None, :] <= query_pos[:, None]) | (torch.arange(c, device=dev) >= n)[:, None]
        group = self.model.group

        def attend(layer, q):
            k, v = self.kv.gather(layer, seq_pages, context, q.dtype)
            k, v = (F.pad(x, (0, 0, 0, 0, 0, keys - context)) for x in (k, v))
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 v.transpose(0, 1)[None], attn_mask=mask[None, None])
            return out[0].transpose(0, 1)

        with sdpa_kernel(PREFILL_ATTENTION):
            h = self.model.layers(ids_t, pos_t, pages_t, slots_t, self.kv, attend)
        picked = [pos - seq.num_computed for pos in rows] + [n - 1]
        return self.model.logits(h[torch.tensor(picked, device=dev)])

    # ------------------------------------------------------------------ step
    def run(self, plan, beat=None, logprob_rows=()) -> torch.Tensor:
        """Logits of the rows that sample, in plan order, then (as `extra_logits`) those of
        `logprob_rows` ((plan index, KV position) pairs, in their order)."""
        wanted: dict[int, list[int]] = {}
        for i, pos in logprob_rows:
            wanted.setdefault(id(plan[i]), []).append(pos)
        extra: dict[tuple[int, int], torch.Tensor] = {}
        decode = [p for p in plan if p.n == 1]
        prefill = [p for p in plan if p.n > 1]
        if len(decode) > self.max_batch:
            raise RuntimeError(f"{len(decode)} decode rows exceed the batch of {self.max_batch}")
        logits = {}
        if decode:
            out, _ = self._decode(decode)
            for i, p in enumerate(decode):
                logits[id(p)] = out[i]
                for pos in wanted.get(id(p), ()):
                    extra[id(p), pos] = out[i]
        ran = None         # the event after the chunk before the last one queued
        for p in prefill:
            if p.n > self.prefill_chunk:
                raise RuntimeError(f"a prefill chunk of {p.n} exceeds {self.prefill_chunk}")
            rows = wanted.get(id(p), [])
            out = self._prefill(p, rows)
            logits[id(p)] = out[len(rows)]
            for j, pos in enumerate(rows):
                extra[id(p), pos] = out[j]
            if beat is not None:   # a step of many chunks is progress, not a hang: beat once each
                # chunk has run, not when it is queued; waiting for the previous chunk's end while
                # this one is queued keeps the GPU fed through the wait
                done = torch.cuda.Event()
                done.record()
                if ran is not None:
                    ran.synchronize()
                    beat()
                ran = done
        if ran is not None:
            ran.synchronize()
            beat()
        self.queued_ns = time.monotonic_ns()
        rows = [logits[id(p)] for p in plan if p.samples]
        more = [extra[id(plan[i]), pos] for i, pos in logprob_rows]
        self.extra_logits = torch.stack(more) if more else None
        return torch.stack(rows) if rows else torch.empty(0, device=self.device)

    def _fault_target(self, plan):
        """What the `cuda_illegal` fault corrupts: the last sealed page of every other row."""
        pt = self.kv.page_tokens
        return self.kv.pool, [p.seq.pages[max(0, p.seq.num_computed // pt - 1)] for p in plan[::2] if p.seq.pages]

    def run_and_sample(self, plan, sampling, beat=None, after_forward=None,
                       logprob_rows=()) -> tuple[list[int], dict[int, int]]:
        """Run the step and pick its tokens; returns (tokens of `sampling`, {page: hash of the
        one slot this step wrote there}) for the engine's commit. A decode-only step reads its
        greedy tokens and slot hashes back in one copy; rows that sample with a temperature
        go through the sampler on their logits; other steps take the general path.
        `after_forward(plan)` runs once a decode step's forward is queued, before the read-back."""
        if logprob_rows or not plan or any(p.n != 1 for p in plan) or len(plan) > self.max_batch:
            logits = self.run(plan, beat, logprob_rows)
            self.sample_logits = logits          # for the log-probs (kvhold.executor.engine)
            return (sample(logits, sampling, self.max_batch) if sampling else []), {}
        logits, out = self._decode(plan)
        if any(seq.sampling.logprobs is not None for seq in sampling):   # the log-probs read them (a copy:
            self.sample_logits = logits[[i for i, p in enumerate(plan) if p.samples]]   # graph buffers)
        faults.point("decode_queued", lambda: self._fault_target(plan))
        if after_forward is not None:
            after_forward(plan)          # queued behind the forward; the read-back waits for it too
        host = out.cpu()
        greedy, hashes = host[0].tolist(), host[1]
        # rows that sample with a temperature, whose min_tokens masks tokens, that are penalized,
        # biased or constrained by a grammar, on their logits
        hot = [i for i, p in enumerate(plan) if p.samples and (p.seq.sampling.temperature > 0 or p.seq.masked_ids()
                                                                or p.seq.sampling.penalized or p.seq.sampling.logit_bias
                                                                or p.seq.grammar is not None)]
        if hot:
            for i, token in zip(hot, sample(logits[hot], [plan[i].seq for i in hot], self.max_batch)):
                greedy[i] = token
        tokens = [greedy[i] for i, p in enumerate(plan) if p.samples]
        if self.hasher is None:
            return tokens, {}
        pt = self.kv.page_tokens
        return tokens, {p.seq.pages[p.seq.num_computed // pt]: h for p, h in zip(plan, hashes.tolist())}
