"""The engine workload: the reference torch engine behind the executor lifecycle.

prepare() (as a standby-to-be): load the weights if this executor is the designated
loader, otherwise wait for them to be sealed and check the fingerprint; map the
weights read-only and the KV pool, build the model, and warm it up on a private
scratch pool (a standby must not write shared pages). promote(): take over the
page table and journal (kvhold.executor.takeover) and return the RecoveryReport, with
the fenced epoch it recovers from. step(): one engine step.
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time

import torch

from kvhold.executor import faults, host_compute, takeover_profile
from kvhold.executor.engine import Engine
from kvhold.executor.grammar import Grammars
from kvhold.executor.kv_cache import TORCH_DTYPES, KvCache
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput
from kvhold.executor.weights import WeightsRegion, wait_until_sealed
from kvhold.executor.workload import WorkloadBase
from kvhold.protocol import messages as m
from kvhold.protocol.checkpoint import Manifest
from kvhold.protocol.memory import Mapping, RegionInfo, map_region
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.recovery_report import RecoveryReport

log = logging.getLogger(__name__)
# Prompt tokens per prefill chunk on CUDA. Exact prefill (the default) runs a chunk at its own
# rows, so a long chunk costs a short prompt nothing; its GEMMs reach their throughput from about
# 1-2k rows (bench/results/prefill_tiles_cuda.json), and at 2,048 a 2k-token prompt is one step.
# The cuBLAS + SDPA path pads every chunk to the chunk size, so it keeps short chunks.
DEFAULT_CUDA_PREFILL_CHUNK = 2048
DEFAULT_CUDA_PREFILL_CHUNK_PADDED = 512
DEFERRED_CAPTURE_STEPS = 8    # an urgent executor captures its decode graph after this many steps


def cuda_prefill_chunk(prefill_chunk: int | None, max_batch_tokens: int, max_batch: int, exact: bool = True) -> int:
    """The prompt tokens per prefill chunk a CUDA executor runs with (--prefill-chunk, or at
    most DEFAULT_CUDA_PREFILL_CHUNK with exact prefill, DEFAULT_CUDA_PREFILL_CHUNK_PADDED
    without, within the step's token budget)."""
    default = DEFAULT_CUDA_PREFILL_CHUNK if exact else DEFAULT_CUDA_PREFILL_CHUNK_PADDED
    return prefill_chunk or min(default, max_batch_tokens - max_batch)


class EngineWorkload(WorkloadBase):
    cold_first_step = True     # the first step may load kernels: longer lease until it is done

    def __init__(self, ctx):
        super().__init__(ctx)
        self.engine: Engine | None = None
        self.runner = None
        self._t = time.monotonic()
        self._active_steps = 0
        path = takeover_profile.target()     # a diagnostic: off unless asked for
        self._profile = takeover_profile.TakeoverProfile(path, os.getpid()) if path else None

    def _phase(self, name: str) -> None:
        now = time.monotonic()
        self.phases[name] = round((now - self._t) * 1e3, 2)
        self._t = now

    slot_hashes = True      # the runner hashes each decode step's slots for the commit

    def prepare(self) -> None:
        ctx, s = self.ctx, self.ctx.settings
        self._t = time.monotonic()
        device = torch.device(s.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            torch.cuda.init()
            self._phase("cuda_context")
        if device.type == "cpu":
            host_compute.setup(s.cpu_threads or max(1, (os.cpu_count() or 2) // 2))
        spec = ModelSpec.from_dir(s.model)
        weights = self._weights(spec)
        self._phase("weights")
        geometry = ctx.tables.geometry
        dtype = TORCH_DTYPES[s.compute_dtype]
        kv = self._kv_cache(geometry, device)
        if s.tensor_parallel_size > 1:   # rank 0 of a group (kvhold.executor.tensor_parallel.ranks)
            from kvhold.executor.tensor_parallel.ranks import start_group

            model = start_group(ctx, spec, weights, s.compute_dtype, kv, geometry.max_seq_len)
            self.group_ranks = model.ranks.pids     # reported in Ready: the supervisor watches them too
            self._phase("tensor_parallel_group")
        else:
            model = LlamaModel(spec, weights, dtype, device, max_positions=geometry.max_seq_len)
        max_batch, max_tokens, chunk = s.max_batch, s.max_batch_tokens, s.prefill_chunk
        runner = checksum = None
        if device.type == "cuda":
            from kvhold.executor.cuda.checksum import TritonChecksum
            from kvhold.executor.cuda.runner import CudaRunner

            chunk = cuda_prefill_chunk(chunk, max_tokens, max_batch, s.exact_prefill)
            runner = CudaRunner(model, kv, max_batch, chunk, geometry.max_pages_per_seq,
                                use_graph=s.cuda_graph, exact=s.exact_prefill,
                                slot_hashes=self.slot_hashes)
            self._phase("model")
            # loads kernels and captures the decode graph; an urgent executor (taking over with
            # no standby ready) warms only the decode path and captures later, between steps
            self.phases.update(runner.prepare(urgent=ctx.urgent))
            self._t = time.monotonic()
            checksum = TritonChecksum(kv.pool)
        else:
            self._warm_up(model, geometry.kv, device)
            self._phase("model_warm_up")
        self.runner = runner
        self.engine = self._make_engine(model, kv, max_batch, max_tokens, runner, checksum, chunk)
        self._phase("engine")
        if geometry.max_extra_bytes:      # structured output: the grammars' tokenizer, built ahead
            self.engine.grammars = Grammars.for_model(s.model, spec.vocab_size, spec.eos_token_ids)
            if self.engine.grammars is not None:
                try:
                    self.engine.grammars.warm()
                    self._phase("grammar_tokenizer")
                except Exception as exc:  # noqa: BLE001 - no llguidance, a tokenizer it cannot read
                    log.warning("no structured output in this executor (%s: %s); constrained requests "
                                "end with an error", type(exc).__name__, str(exc)[:200])
                    self.engine.grammars = None
        self.engine.warm_up_sampler()
        if device.type == "cuda":
            torch.cuda.synchronize()
            self._phase("sampler_warm_up")
        zero = torch.zeros(1, dtype=torch.long, device=device)   # warm the checksum kernels (read-only)
        self.engine.checksum.pages(zero, zero)
        self.engine.checksum.ranges(zero, zero, zero + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
            self._phase("checksum_warm_up")
            takeover_profile.warm_up()
            self.private_mib = torch.cuda.memory_reserved(device) / 2**20
            log.info("standby ready on %s: %.0f MiB private GPU memory reserved by torch", device,
                     self.private_mib)
        gc.freeze()     # the warmed-up heap (torch, the model, kernels) is out of the GC's scans

    def _kv_cache(self, geometry, device) -> KvCache:
        """The pool the engine computes into: kvhold's shared pages (kvhold.executor.foreign_pool overrides)."""
        return KvCache.from_mapping(self.ctx.mappings["kv"], geometry.kv, geometry.num_pages)

    def _make_engine(self, model, kv, max_batch, max_tokens, runner, checksum, chunk) -> Engine:
        return Engine(model, kv, self.ctx.tables, self.ctx.lease, max_batch, max_tokens,
                      runner=runner, checksum=checksum, prefill_chunk=chunk, prefix_salt=self._prefix_salt())

    def _prefix_salt(self) -> bytes | None:
        """What makes a cached page's KV besides its tokens: the weights and the KV dtype."""
        s = self.ctx.settings
        if not s.prefix_caching:
            return None
        return f"{self.ctx.attached.weights['fingerprint']}:{s.compute_dtype}".encode()

    def _weights(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        ctx = self.ctx
        info = ctx.attached.weights
        manifest = Manifest.from_wire(info["manifest"])
        if manifest.fingerprint != info["fingerprint"]:
            raise RuntimeError("the manifest does not match the sidecar's fingerprint")
        region = WeightsRegion(ctx.mappings["weights"], manifest, ctx.settings.model)
        designated = info["loader"] or not wait_until_sealed(ctx.tables, manifest.fingerprint,
                                                              ctx.epoch, ctx.beat)
        if designated:
            if not info["loader"]:  # designated after attach: our mapping is read-only
                region = WeightsRegion(self._writable_weights(), manifest, ctx.settings.model)
            ctx.channel.send(m.WeightsLoading(slot=ctx.attached.slot, epoch=ctx.epoch))
            load_ms = region.load(beat=ctx.beat)
            faults.point("weights_loaded")     # crash tests: a loader dying before it seals
            log.info("loaded %d tensors (%.1f MiB) in %.0f ms", len(manifest.entries),
                     manifest.region_bytes / 2**20, load_ms)
            ctx.channel.send(m.WeightsSealed(slot=ctx.attached.slot, epoch=ctx.epoch,
                                             fingerprint=manifest.fingerprint, load_ms=load_ms))
        else:
            log.info("weights already sealed (fingerprint %s): mapped, not loaded", manifest.fingerprint[:12])
        return region.tensors()

    def _writable_weights(self) -> Mapping:
        fds = self.ctx.channel.fetch_fds(self.ctx.attached)
        try:
            info = next(RegionInfo.from_wire(d) for d in self.ctx.attached.regions if d["name"] == "weights")
            return map_region(fds["weights"], info.with_access(False))
        finally:
            for fd in fds.values():
                os.close(fd)

    @staticmethod
    def _warm_up(model: LlamaModel, kv_geometry, device) -> None:
        """Exercise every kernel once on a private pool, so the first real step is not cold."""
        scratch = KvCache.private(kv_geometry, 1, device)
        n = min(4, kv_geometry.page_tokens)
        pages = torch.zeros(n, dtype=torch.long, device=device)
        step = StepInput(token_ids=torch.zeros(n, dtype=torch.long, device=device),
                         positions=torch.arange(n, device=device), write_pages=pages,
                         write_slots=torch.arange(n, device=device),
                         seqs=[SeqSlice(0, n, n, pages[:1])],
                         logits_rows=torch.tensor([n - 1], device=device))
        model.forward(step, scratch)

    # ------------------------------------------------------------------ workload interface
    def promote(self, msg: m.Promote) -> RecoveryReport:
        if self._profile is not None and msg.fenced_epoch:
            with self._profile.part("takeover"):
                report = self.engine.take_over(msg.pending_epochs, msg.detect_ns, msg.isolate or ())
            self._profile.steps_after = 0
        else:
            report = self.engine.take_over(msg.pending_epochs, msg.detect_ns, msg.isolate or ())
        report = dataclasses.replace(report, fenced_epoch=msg.fenced_epoch)
        log.info("took over: %d resumable, %d damaged, %d lost, %d pages checked (%d bad), "
                 "%d tokens recomputed", report.requests_resumable, report.requests_damaged,
                 report.requests_lost, report.pages_checked, report.pages_bad, report.tokens_recomputed)
        if getattr(self.engine, "takeover_trace", ""):
            log.info("takeover host marks (ms from its start): %s", self.engine.takeover_trace)
        return report

    def has_work(self) -> bool:
        return self.engine.has_work

    def maintain(self) -> None:
        reset = getattr(self.engine, "reset_prefix_cache_if_asked", None)   # an engine bridge's has none
        if reset is None:
            return
        evicted = reset()
        if evicted is not None:
            log.info("prefix cache reset: %d idle cached pages freed", evicted)
        self.engine.verify_cache()

    def idle(self) -> None:
        ahead = getattr(self.engine, "tokens_ahead", None)     # an engine bridge's has none
        if ahead is not None:
            ahead.refresh()

    def step(self) -> list[int]:
        if self._profile is not None:
            with self._profile.step():
                slots = self.engine.step()
        else:
            slots = self.engine.step()
        self._active_steps += 1
        if (self.runner is not None and self.runner.capture_pending
                and self._active_steps >= DEFERRED_CAPTURE_STEPS):
            t0 = time.monotonic()
            self.runner.capture()
            log.info("captured the deferred decode graph in %.0f ms", (time.monotonic() - t0) * 1e3)
        return slots

    def flush(self) -> list[int]:
        """Publish what the last step left pending (a graceful stop)."""
        return self.engine.flush() if self.engine is not None else []

    def take_step_tokens(self) -> list[int]:
        """The tokens of each step since the last call (vLLM's iteration tokens)."""
        counts, self.engine.step_tokens = self.engine.step_tokens, []
        return counts

    def take_marks(self) -> dict:
        """The first step after a takeover: its parts (ns), once."""
        marks, self.engine.first_step_marks = self.engine.first_step_marks, {}
        return marks

    def on_reaped(self, epochs) -> None:
        released = self.engine.release_quarantined(epochs)
        if released:
            log.info("released %d quarantined pages of exited epochs %s", released, list(epochs))
