"""Run a TensorRT-LLM executor under the kvhold sidecar: `python -m kvhold.trtllm_bridge.launcher`.

Written against TensorRT-LLM 1.2 (repository NVIDIA/TensorRT-LLM). Read: tensorrt_llm/llmapi/llm.py
(stored version 00966934, older than 1.2: `generate_async(inputs, sampling_params, ...,
streaming=)` returns a `RequestOutput`); tests/unittest/_torch/test_connector.py (`LLM(...,
kv_connector_config=, kv_cache_config=KvCacheConfig(...))` and `TLLM_WORKER_USE_SINGLE_PROCESS=1`,
which keeps the PyExecutor in this process, so the connector shares this process's kvhold
state); the 1.2.0rc0 docs' example (examples/llm-api/llm_kv_cache_connector.py:
`KvCacheConnectorConfig(connector_module=, connector_scheduler_class=, connector_worker_class=)`);
tensorrt_llm/llmapi/llm_args.py (`checkpoint_loader`). Assumed from the LLM API docs, not read
in source: streaming `RequestOutput` iteration with cumulative `outputs[0].token_ids` and
`finish_reason`, `RequestOutput.request_id` = the client id, `abort()`, and
`SamplingParams(max_tokens, temperature, top_k, top_p, seed, stop_token_ids, ignore_eos)`.

The launcher is an executor like `python -m kvhold.executor`: it attaches with the sidecar's token,
holds a lease, maps the tables, the weights region and the KV region, and follows the
standby -> active lifecycle (kvhold.executor.runtime). Its workload (`TrtllmWorkload`):
* prepare: weights from the region (the designated loader fills and seals it first), an
  `LLM` built with `KvholdCheckpointLoader` (trtllm_weights) and the kvhold connector
  (trtllm_connector), KV blocks of `page_tokens` tokens, block reuse on, the
  GUARANTEED_NO_EVICT scheduler and CUDA graphs off (`llm_kwargs` says why); a standby is
  fully warmed.
* promote: validate the mirrored pages of every live journal request
  (`KvMirror.plan_restore`, full blocks only), then resubmit each (prompt plus committed
  tokens); the connector loads the intact blocks instead of prefilling them, and the
  recovery report, made once those loads are done, counts what was loaded.
* step: admit new journal requests, then commit streamed tokens to the journal (their KV was
  mirrored by the connector at the end of the forward pass that produced them).
Continuations after a takeover equal an uninterrupted run for greedy requests; TensorRT-LLM's
sampler does not key its random stream by (seed, position), so sampled requests continue
validly but not bit-identically. TP=1 only (one kvhold pool per GPU).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time

import torch

from kvhold.executor.engine_bridge import BridgeWorkload
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.takeover import MAX_REPORTED_REQUESTS
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import FinishReason
from kvhold.protocol.leases import now_ns
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.page_table import PageTable
from kvhold.protocol.recovery_report import RecoveryReport, RequestRecovery
from kvhold.protocol.settings import TRTLLM_UNSUPPORTED, ExecutorSettings
from kvhold.trtllm_bridge.trtllm_connector import Bridge, install

log = logging.getLogger(__name__)
CONNECTOR = {"connector_module": "kvhold.trtllm_bridge.trtllm_connector",
             "connector_scheduler_class": "KvholdConnectorScheduler",
             "connector_worker_class": "KvholdConnectorWorker"}
REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "cancelled": FinishReason.CANCELLED}
# sampling fields the launcher refuses (TRTLLM_UNSUPPORTED): those no engine bridge honours across
# a takeover (TensorRT-LLM's own min_tokens masking stops that are not kvhold's, its penalties'
# state not restored from kvhold's journal, grammars, logit_bias), and log-probs, which it does not
# ask TensorRT-LLM for nor journal. A sidecar run with --workload trtllm refuses them at admission
# (a 400 naming the field); this refusal is for a sidecar run otherwise, where such a request would
# otherwise be held to its end and streamed with log-probs of 0
UNSUPPORTED = TRTLLM_UNSUPPORTED


# Keys of the LLM arguments the bridge owns: an --llm-options file setting one is refused.
OWNED = {
    "model": "the sidecar's --model",
    "checkpoint_loader": "the bridge loads weights from the sidecar's region",
    "checkpoint_format": "TensorRT-LLM ignores checkpoint_loader when checkpoint_format is set "
                         "(TorchLlmArgs.validate_checkpoint_format), which would bypass the sidecar's weights",
    "kv_connector_config": "the bridge's connector mirrors the KV pool",
    "connector_config": "the TensorRT-LLM 1.0 name of kv_connector_config; 1.0 is not supported",
    "tensor_parallel_size": "one kvhold pool per GPU: TP=1 only",
    "speculative_config": "TensorRT-LLM refuses a KV connector with speculative decoding "
                          "(py_executor_creator.py: 'KV connector is not supported with speculative decoding')",
}
# TensorRT-LLM turns CUDA graphs on by default (TorchLlmArgs.cuda_graph_config = CudaGraphConfig());
# with a KV connector, some of its versions refuse them at start (py_executor_creator.py: "CUDA
# graphs are not supported with KV connector hooks") and its own connector tests and examples
# (tests/unittest/_torch/test_connector.py, llm_kv_cache_connector) all run with
# cuda_graph_config=None: the bridge pins them off.
NO_CUDA_GRAPHS = ("CUDA graphs stay off with the kvhold connector (TensorRT-LLM refuses them with a KV "
                  "connector in some versions and tests connectors only without them); set "
                  "cuda_graph_config: null or leave it out")
# attention backend -> token order inside a KV block (resource_manager.get_buffers' kv_layout)
BACKEND_LAYOUTS = {"TRTLLM": "hnd", "VANILLA": "nhd", "FLASHINFER": "nhd"}
NO_EVICT = "GUARANTEED_NO_EVICT"


def llm_kwargs(settings: ExecutorSettings, geometry, options: dict | None = None) -> dict:
    """Keyword arguments for `tensorrt_llm.LLM`, as plain values (objects made in `build_llm`).

    KV blocks hold exactly kvhold's `page_tokens`. Block reuse is on: TensorRT-LLM asks the
    connector for matched tokens only when it is (kvCacheManager.cpp's addSequence), so without
    it nothing would be loaded after a takeover. The capacity scheduler is GUARANTEED_NO_EVICT,
    the only policy TensorRT-LLM accepts with a connector. CUDA graphs are off
    (`cuda_graph_config=None`; `NO_CUDA_GRAPHS` says why). `options` (a YAML mapping, as for
    trtllm-serve's --extra_llm_api_options) is applied last; a key the bridge owns (`OWNED`),
    or a value contradicting one it pins, is refused with a ValueError that names it."""
    kv_cache = {"tokens_per_block": geometry.kv.page_tokens, "enable_block_reuse": True}
    kw = {"model": settings.model, "max_batch_size": settings.max_batch,
          "max_num_tokens": settings.max_batch_tokens, "max_seq_len": geometry.max_seq_len,
          "kv_cache_config": dict(kv_cache), "scheduler_config": {"capacity_scheduler_policy": NO_EVICT},
          "kv_connector_config": dict(CONNECTOR), "cuda_graph_config": None}
    for key, value in (options or {}).items():
        if key in OWNED:
            raise ValueError(f"--llm-options may not set {key}: {OWNED[key]}")
        if key == "cuda_graph_config" and value is not None:
            raise ValueError(f"--llm-options may not set cuda_graph_config={value!r}: {NO_CUDA_GRAPHS}")
        if key == "kv_cache_config":
            value = _pinned(key, value, kv_cache)
        elif key == "scheduler_config":
            value = _pinned(key, value, {"capacity_scheduler_policy": NO_EVICT})
        kw[key] = value
    return kw


def _pinned(key: str, value, pinned: dict) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"--llm-options {key} must be a mapping")
    for name, want in pinned.items():
        if name in value and str(value[name]).rsplit(".", 1)[-1] != str(want):
            raise ValueError(f"--llm-options may not set {key}.{name}={value[name]!r}: "
                             f"the bridge needs {want!r}")
    return {**value, **pinned}


def kv_layout(options: dict | None, override: str | None = None) -> str:
    """Token order inside a TensorRT-LLM KV block: "hnd" or "nhd".

    TensorRT-LLM's pool is [blocks, layers, 2, tokens*heads*dim] and each attention backend
    lays a block out its own way: the TRTLLM backend (the default) as [heads][tokens][dim]
    (the KV cache manager's partial-block copy, cpp/tensorrt_llm/kernels/kvCachePartialCopy.cu
    at a90a0166, indexes it so), VANILLA through `KVCacheManager.get_buffers(layer)`'s
    [blocks, 2, tokens, heads, dim] view (resource_manager.py, b35ac1b6) and FLASHINFER with
    `FlashInferAttentionMetadata.kv_layout = "NHD"` (attention_backend/flashinfer.py). `override`
    (--kv-layout) wins; an unknown backend without one is refused rather than guessed."""
    backend = str((options or {}).get("attn_backend", "TRTLLM")).upper()
    if override:
        return override
    if backend not in BACKEND_LAYOUTS:
        raise ValueError(f"attn_backend {backend!r}: its KV block layout is not known to the bridge; "
                         "pass --kv-layout hnd|nhd")
    return BACKEND_LAYOUTS[backend]


def sampling_kwargs(entry, num_generated: int) -> dict:
    """`SamplingParams` keywords for a journal entry resumed after `num_generated` tokens."""
    p = entry.sampling
    return {"max_tokens": p.max_tokens - num_generated, "temperature": p.temperature,
            "top_p": p.top_p, "top_k": p.top_k or None, "seed": p.seed,
            "stop_token_ids": list(p.stop_token_ids) or None, "ignore_eos": p.ignore_eos}


def build_llm(kwargs: dict, weights):                    # pragma: no cover - needs TensorRT-LLM
    from tensorrt_llm import LLM
    from tensorrt_llm.llmapi.llm_args import (
        CapacitySchedulerPolicy,
        KvCacheConfig,
        KvCacheConnectorConfig,
        SchedulerConfig,
        TorchLlmArgs,
    )

    from kvhold.trtllm_bridge.trtllm_weights import KvholdCheckpointLoader

    if "kv_connector_config" not in TorchLlmArgs.model_fields:
        raise RuntimeError("this TensorRT-LLM has no kv_connector_config (1.0 named it connector_config, "
                           "with connector classes built from an ExecutorConfig): TensorRT-LLM 1.2 or later is needed")
    kwargs = dict(kwargs)
    kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
    kwargs["scheduler_config"] = SchedulerConfig(**{
        **kwargs["scheduler_config"], "capacity_scheduler_policy": CapacitySchedulerPolicy.GUARANTEED_NO_EVICT})
    connector = KvCacheConnectorConfig(**kwargs.pop("kv_connector_config"))
    return LLM(checkpoint_loader=KvholdCheckpointLoader(weights), kv_connector_config=connector, **kwargs)


class TrtllmWorkload(BridgeWorkload):
    """The executor workload behind `python -m kvhold.trtllm_bridge.launcher` (module docstring).
    What `UNSUPPORTED` names is refused (finished with ERROR, logged with the field): the
    sidecar, which spawns no executor here, cannot know to refuse it at admission. `live` maps
    a journal slot to its `RequestOutput`."""

    unsupported = UNSUPPORTED

    def __init__(self, ctx, options: dict | None = None, head_major: bool = True):
        super().__init__(ctx)
        self.options, self.head_major = options or {}, head_major
        self.events: queue.Queue = queue.Queue()

    def mirror_lock(self):
        return self.bridge.lock          # the connector mirrors on TensorRT-LLM's executor thread

    def prepare(self) -> None:
        os.environ.setdefault("TLLM_WORKER_USE_SINGLE_PROCESS", "1")
        s, tables = self.ctx.settings, self.ctx.tables
        if s.kv_mode != "foreign":
            raise RuntimeError("TensorRT-LLM keeps its own KV pool: run the sidecar with --kv-mode foreign")
        torch.cuda.set_device(torch.device(s.device))
        weights = self._weights(ModelSpec.from_dir(s.model))
        kv = KvCache.from_mapping(self.ctx.mappings["kv"], tables.geometry.kv, tables.geometry.num_pages)
        self.bridge = Bridge(tables, kv.pool, self.ctx.lease, head_major=self.head_major)
        install(self.bridge)
        self.journal = Journal(tables)
        self.llm = build_llm(llm_kwargs(s, tables.geometry, self.options), weights)
        self._phase("llm")

    # ------------------------------------------------------------------ takeover
    settle_timeout_s = 30.0          # how long promote waits for the resubmitted requests' loads

    def promote(self, msg) -> RecoveryReport:
        """Validate the mirror, resubmit every live request, and report what was loaded.

        The report is made once the connector has answered for each resubmitted request and
        made its load (or `settle_timeout_s` passed: the rest are logged, not counted), so
        `tokens_kept` is what the engine got from kvhold pages and `tokens_recomputed` what
        it computes again of the KV the dead executor had mirrored."""
        t0, bt = now_ns(), self.ctx.tables.geometry.kv.page_tokens
        entries = self._live_entries()
        counts = PageTable(self.ctx.tables).snapshot()["num_tokens"]
        recorded = {e.request_id: min(max(0, e.num_tokens - 1), int(sum(
            min(int(counts[p]), bt) for p in self.journal.pages_of(e.slot, e.num_pages).tolist())))
            for e in entries}
        plans = self._plan_restore(entries, msg.pending_epochs, full_blocks_only=True)
        validated = now_ns()
        self.bridge.restorable = {rid: p.pages for rid, p in plans.items() if p.pages}
        self.bridge.await_outcomes(recorded)
        for e in entries:
            self._submit(e)
        resumed = now_ns()
        self._await_settled()
        with self.bridge.lock:
            outcomes = {rid: self.bridge.outcomes.pop(rid) for rid in recorded}
        report = recovery_report(msg, self.bridge.mirror.last_restore, plans, recorded, outcomes,
                                 promoted_ns=t0, validated_ns=validated, resumed_ns=resumed)
        for e in entries:
            o = outcomes[e.request_id]
            if o.settled and recorded[e.request_id] > o.covered:
                self.journal.add_counter(e.slot, "num_recomputed", recorded[e.request_id] - o.covered)
        return report

    def _await_settled(self) -> None:
        deadline = time.monotonic() + self.settle_timeout_s
        while (waiting := self.bridge.unsettled()) and time.monotonic() < deadline:
            self.ctx.beat()
            self.ctx.lease.check()
            time.sleep(0.002)
        if waiting:
            log.warning("%d resubmitted requests not scheduled within %.0f s: their loads are not "
                        "in the recovery report", len(waiting), self.settle_timeout_s)

    # ------------------------------------------------------------------ serving
    def _submit(self, entry) -> None:
        from tensorrt_llm import SamplingParams  # pragma: no cover - needs TensorRT-LLM

        tokens = self.journal.all_tokens(entry.slot, entry.num_tokens).tolist()
        self.bridge.expect(tokens, entry.request_id)
        out = self.llm.generate_async(tokens, SamplingParams(**sampling_kwargs(entry, entry.num_generated)),
                                      streaming=True)
        self.bridge.client_ids[int(out.request_id)] = entry.request_id
        self._track(entry, out)
        threading.Thread(target=self._drain, args=(entry.slot, out), daemon=True).start()

    def _drain(self, slot: int, out) -> None:
        """Engine results -> events for the main loop (which alone writes the journal)."""
        for step in out:
            c = step.outputs[0]
            self.events.put((slot, out, list(c.token_ids), step.finished, c.finish_reason))

    def step(self) -> list[int]:
        self._admit()
        changed = self._cancel()
        try:
            events = [self.events.get(timeout=0.005)]
        except queue.Empty:
            return changed
        while not self.events.empty():
            events.append(self.events.get_nowait())
        for slot, out, tokens, finished, reason in events:
            if self.live.get(slot) is not out:
                continue            # a submission that ended already (aborted): the slot is not its now
            if self._commit(slot, tokens, finished, reason):
                changed.append(slot)
        return changed

    def _cancel(self) -> list[int]:
        """Abort the engine requests whose journal entry the client cancelled."""
        done = []
        for slot, out in list(self.live.items()):
            if self.journal.is_cancelled(slot):
                out.abort()
                self._commit(slot, [], True, "cancelled")
                done.append(slot)
        return done

    def _commit(self, slot: int, tokens: list[int], finished: bool, reason) -> bool:
        """Journal the tokens this output adds, list the mirrored pages, finish if done.

        `tokens` is the cumulative output of this executor's submission, which began after
        `self.offsets[slot]` tokens were already committed (they are part of its prompt)."""
        e, new = self._new_tokens(slot, tokens)
        for token in new:
            e = self._append_token(slot, e, token)
        with self.bridge.lock:
            self._list_pages(slot, e.request_id)
            if finished:
                self._end_request(slot, e.request_id, REASONS.get(reason, FinishReason.STOP))
        return bool(new) or finished


def recovery_report(msg, stats: dict, plans: dict, recorded: dict, outcomes: dict, *,
                    promoted_ns: int, validated_ns: int, resumed_ns: int) -> RecoveryReport:
    """The takeover's report from what the connector loaded (`Outcome`s), not from the plan.

    Per request: kept = tokens copied from kvhold pages into the engine; recomputed = KV the dead
    executor had mirrored (`recorded`) that the engine computes again, i.e. beyond what it got
    from kvhold or its own radix tree. A request not settled is counted in neither."""
    rows = []
    for rid, plan in plans.items():
        o = outcomes.get(rid)
        kept = o.loaded if o is not None else 0
        again = max(0, recorded.get(rid, 0) - o.covered) if o is not None and o.settled else 0
        klass = "resumable" if plan.restored.first_bad is None else ("damaged" if kept else "lost")
        rows.append(RequestRecovery(request_id=rid, klass=klass, first_bad_page=plan.restored.first_bad,
                                    kv_kept=kept, tokens_recomputed=again))
    return RecoveryReport(
        detect_ns=msg.detect_ns, promoted_ns=promoted_ns, validated_ns=validated_ns, resumed_ns=resumed_ns,
        fenced_epoch=msg.fenced_epoch, kv_mode="foreign-trtllm",
        pages_checked=stats["pages_checked"], pages_bad=stats["pages_bad"],
        pages_quarantined=stats["pages_quarantined"], tokens_kept=sum(r.kv_kept for r in rows),
        requests_resumable=sum(r.klass == "resumable" for r in rows),
        requests_damaged=sum(r.klass == "damaged" for r in rows),
        requests_lost=sum(r.klass == "lost" for r in rows),
        tokens_recomputed=sum(r.tokens_recomputed for r in rows), requests=rows[:MAX_REPORTED_REQUESTS])


def main(argv=None) -> int:                              # pragma: no cover - needs TensorRT-LLM
    import argparse
    from pathlib import Path

    import yaml

    from kvhold.executor.runtime import ExecutorConfig, ExecutorRuntime
    from kvhold.protocol.logs import setup_logging

    p = argparse.ArgumentParser(prog="python -m kvhold.trtllm_bridge.launcher",
                                description="Run one TensorRT-LLM executor under a kvhold sidecar.")
    p.add_argument("--instance", default=os.environ.get("KVHOLD_INSTANCE", "default"))
    p.add_argument("--runtime-root", type=Path, default=None)
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument("--llm-options", type=Path, default=None,
                   help="YAML of extra tensorrt_llm.LLM arguments (as trtllm-serve --extra_llm_api_options)")
    p.add_argument("--kv-layout", choices=("hnd", "nhd"), default=None,
                   help="token order inside a TensorRT-LLM KV block (default: from attn_backend, "
                        "hnd for TRTLLM, nhd for VANILLA and FLASHINFER)")
    p.add_argument("--log-level", default=os.environ.get("KVHOLD_LOG_LEVEL", "INFO"))
    args = p.parse_args(argv)
    setup_logging(args.log_level, role="trtllm")
    options = yaml.safe_load(args.llm_options.read_text()) if args.llm_options else {}
    head_major = kv_layout(options, args.kv_layout) == "hnd"
    factory = lambda name, ctx: TrtllmWorkload(ctx, options, head_major=head_major)
    cfg = ExecutorConfig(instance=args.instance, runtime_root=args.runtime_root,
                         token_file=args.token_file, workload_factory=factory)
    return ExecutorRuntime(cfg).run()


if __name__ == "__main__":                               # pragma: no cover
    raise SystemExit(main())
