"""TensorRT-LLM KV Cache Connector that mirrors the engine's KV pool into kvhold.

Written against TensorRT-LLM 1.2 (repository NVIDIA/TensorRT-LLM). Sources read, by path;
the stored versions were commit 00fdcbff (kv_cache_connector.py: the `llm_args: TorchLlmArgs`
signatures of the 1.2 docs' example, nvidia.github.io/TensorRT-LLM/1.2.0rc0/examples/
llm_kv_cache_connector.html) and b35ac1b6 (version.py = 1.2.0rc2) where available:
* tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py: `KvCacheConnectorScheduler(llm_args)`
  with `build_connector_meta(scheduler_output: SchedulerOutput)`,
  `get_num_new_matched_tokens(request: LlmRequest, num_computed_tokens: int) -> (int, bool)`,
  `request_finished(request, cache_block_ids: List[int]) -> bool`,
  `update_state_after_alloc(request, block_ids: List[int])`; `KvCacheConnectorWorker(llm_args)`
  with `register_kv_caches(kv_cache_tensor)`, `start_load_kv(stream)`,
  `wait_for_layer_load(layer_idx, stream)`, `save_kv_layer(layer_idx, stream)`,
  `wait_for_save(stream)`, `get_finished(finished_gen_req_ids, started_loading_req_ids)`;
  `bind_connector_meta` / `self._metadata`; `SchedulerOutput.new_requests / cached_requests`
  of `RequestData(request_id, new_tokens, new_block_ids, computed_position,
  num_scheduled_tokens)`; `KvCacheConnectorManager.get_num_new_matched_tokens` (raises if
  0 tokens are returned with async=True) and `KvCacheConnectorSchedulerOutputManager` (it
  subtracts the connector-matched tokens from a new request's `computed_position`).
* tensorrt_llm/_torch/pyexecutor/py_executor.py: `PyExecutor.__init__` calls
  `worker.register_kv_caches(kv_cache_manager.get_unique_primary_pool())` once and hooks
  every `DecoderLayer` (pre: `wait_for_layer_load`, post: `save_kv_layer`).
* tensorrt_llm/_torch/pyexecutor/resource_manager.py: `KVCacheManager.get_unique_primary_pool()`
  (one tensor for all layers: [num_blocks, num_layers, kv_factor=2, tokens*heads*head_dim]),
  `get_buffers(layer_idx)`.
* tensorrt_llm/llmapi/llm_args.py: `KvCacheConnectorConfig(connector_module,
  connector_scheduler_class, connector_worker_class)`; the LLM argument is
  `kv_connector_config` (`connector_config` in 1.0); examples/llm-api/llm_kv_cache_connector.py.

How it protects the engine: after each forward pass (`wait_for_save`, stream synchronized) the
worker mirrors every block the pass wrote (kvhold.executor.kv_mirror, kvhold's versioned and
checksummed pages), before the step's tokens reach the launcher and the journal. After a
takeover the launcher validates the mirrored pages (`KvMirror.plan_restore`, full blocks only)
and resubmits every journaled request; `get_num_new_matched_tokens` reports the intact
prefix as externally matched and `start_load_kv` copies it into the blocks TensorRT-LLM just
allocated, so no intact block is prefilled again.

The scheduler and the worker share one `Bridge` installed by the launcher in this process
(TP=1, `TLLM_WORKER_USE_SINGLE_PROCESS=1`). The logic lives in `MirrorPlanner` and
`MirrorExecutor` (no TensorRT-LLM types: tested on CPU); the connector classes are thin.
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

from kvhold.executor.block_layout import PooledBlocks
from kvhold.executor.kv_mirror import Committed, KvMirror

log = logging.getLogger(__name__)


@dataclass
class Bridge:
    """What the launcher shares with the connector: kvhold's tables, pool and lease, request ids."""

    tables: object
    kv_pool: object                          # kvhold's KV region [pages, L, 2, T, H, D]
    lease: object
    head_major: bool = True                  # TensorRT-LLM blocks are [heads][tokens][dim] (HND)
    client_ids: dict[int, int] = field(default_factory=dict)   # LLM API client id -> kvhold id
    expected: dict[tuple, list[int]] = field(default_factory=dict)  # submitted tokens -> kvhold ids
    restorable: dict[int, tuple[int, ...]] = field(default_factory=dict)  # kvhold id -> pages
    mirror: KvMirror | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)   # engine thread vs launcher

    def expect(self, tokens, kvhold_id: int) -> None:
        """Called by the launcher just before it submits `tokens` for a kvhold request."""
        self.expected.setdefault(tuple(tokens), []).append(kvhold_id)

    def kvhold_id(self, request) -> int | None:
        """The kvhold request behind an engine request: by LLM API client id once the launcher
        knows it, else by its submitted tokens when exactly one pending request has them (two
        requests are never confused: an ambiguous one stays unresolved until the id arrives)."""
        client = getattr(request, "py_client_id", getattr(request, "client_id", None))
        if client is not None and int(client) in self.client_ids:
            return self.client_ids[int(client)]
        if request is None or not hasattr(request, "get_tokens"):
            return None
        ids = self.expected.get(tuple(request.get_tokens(0)), [])
        return ids[0] if len(ids) == 1 else None


_BRIDGE: Bridge | None = None


def install(bridge: Bridge) -> None:
    global _BRIDGE
    _BRIDGE = bridge


def current() -> Bridge:
    if _BRIDGE is None:
        raise RuntimeError("no kvhold bridge installed: run TensorRT-LLM through kvhold.trtllm_bridge.launcher")
    return _BRIDGE


@dataclass
class ConnectorMeta:
    save: list[Committed] = field(default_factory=list)
    load_pages: list[int] = field(default_factory=list)
    load_blocks: list[int] = field(default_factory=list)


@dataclass
class _Tracked:
    kvhold_id: int | None
    request: object = None                   # the engine's LlmRequest, to resolve kvhold_id later
    blocks: list[int] = field(default_factory=list)
    matched_blocks: int = 0                  # blocks the connector loads for this request


class MirrorPlanner:
    """Scheduler side: which blocks to load before, and to mirror after, each forward pass."""

    def __init__(self, bridge: Bridge, block_tokens: int):
        self.bridge, self.block_tokens = bridge, block_tokens
        self.tracked: dict[int, _Tracked] = {}

    def matched_tokens(self, request_id: int, kvhold_id: int | None, num_prompt: int,
                       num_computed: int, request=None) -> int:
        """Tokens beyond the device's own prefix hits that kvhold can load (whole blocks; at least
        one prompt token is left for the engine to compute)."""
        bt = self.block_tokens
        pages = self.bridge.restorable.get(kvhold_id, ()) if kvhold_id else ()
        usable = min(len(pages), max(0, num_prompt - 1) // bt)
        first = math.ceil(num_computed / bt)
        matched = max(0, usable - first)
        self.tracked[request_id] = _Tracked(kvhold_id, request, matched_blocks=matched)
        return matched * bt

    def build(self, new_requests, cached_requests) -> ConnectorMeta:
        meta = ConnectorMeta()
        for data in new_requests:
            t = self.tracked.setdefault(data.request_id, _Tracked(None))
            t.blocks.extend(data.new_block_ids)
            start = data.computed_position
            if t.matched_blocks and t.kvhold_id:
                self._load(meta, t, start // self.block_tokens)
                start += t.matched_blocks * self.block_tokens
            self._save(meta, t, start, data.num_scheduled_tokens)
        for data in cached_requests:
            t = self.tracked.setdefault(data.request_id, _Tracked(None))
            t.blocks.extend(data.new_block_ids)
            self._save(meta, t, data.computed_position, data.num_scheduled_tokens)
        return meta

    def _load(self, meta: ConnectorMeta, t: _Tracked, first: int) -> None:
        pages = self.bridge.restorable.pop(t.kvhold_id, ())
        for i in range(first, first + t.matched_blocks):
            meta.load_pages.append(pages[i])
            meta.load_blocks.append(t.blocks[i])

    def _save(self, meta: ConnectorMeta, t: _Tracked, start: int, n: int) -> None:
        if t.kvhold_id is None and t.request is not None:
            t.kvhold_id = self.bridge.kvhold_id(t.request)
        if t.kvhold_id is None or n <= 0:
            return                           # not a kvhold request: nothing to protect
        bt, end = self.block_tokens, start + n
        for i in range(start // bt, (end - 1) // bt + 1):
            meta.save.append(Committed(t.kvhold_id, i, t.blocks[i], min(bt, end - i * bt)))

    def finished(self, request_id: int) -> None:
        """Forget it; the launcher releases its pages once the journal no longer lists them."""
        self.tracked.pop(request_id, None)


class MirrorExecutor:
    """Worker side: owns the KvMirror over the engine's registered pool."""

    def __init__(self, bridge: Bridge, block_tokens: int, num_kv_heads: int, head_dim: int):
        self.bridge, self.block_tokens = bridge, block_tokens
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.layout: PooledBlocks | None = None

    def register(self, pool) -> None:
        """`pool` is `KVCacheManager.get_unique_primary_pool()`: [blocks, layers, 2, T*H*D]."""
        self.layout = PooledBlocks(pool, self.num_kv_heads, self.head_dim, self.block_tokens,
                                   head_major=self.bridge.head_major)
        if self.bridge.mirror is None:
            self.bridge.mirror = KvMirror(self.bridge.tables, self.bridge.kv_pool, self.layout,
                                          self.bridge.lease)
        else:                                # restored before the engine existed: now it has blocks
            self.bridge.mirror.layout = self.layout

    def load(self, meta: ConnectorMeta | None) -> None:
        if meta is not None and meta.load_pages:
            with self.bridge.lock:
                self.bridge.mirror.load(meta.load_pages, meta.load_blocks, self.layout)

    def save(self, meta: ConnectorMeta | None) -> int:
        if meta is None or not meta.save:
            return 0
        with self.bridge.lock:
            return self.bridge.mirror.mirror_committed(meta.save)


try:                                          # the glue proper: only where TensorRT-LLM imports
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (KvCacheConnectorScheduler,
                                                                   KvCacheConnectorWorker)
except ImportError:                           # pragma: no cover - exercised where it is installed
    KvCacheConnectorScheduler = KvCacheConnectorWorker = None


def _geometry(llm_args) -> tuple[int, int, int]:
    bridge = current()
    kv = bridge.tables.geometry.kv
    tokens = llm_args.kv_cache_config.tokens_per_block
    if tokens != kv.page_tokens:
        raise ValueError(f"kv_cache_config.tokens_per_block={tokens}, kvhold pages hold {kv.page_tokens}")
    return tokens, kv.num_kv_heads, kv.head_dim


if KvCacheConnectorScheduler is not None:

    class KvholdConnectorScheduler(KvCacheConnectorScheduler):
        def __init__(self, llm_args):
            super().__init__(llm_args)
            self.planner = MirrorPlanner(current(), _geometry(llm_args)[0])

        def build_connector_meta(self, scheduler_output):
            return self.planner.build(scheduler_output.new_requests, scheduler_output.cached_requests)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            tokens = self.planner.matched_tokens(request.request_id, current().kvhold_id(request),
                                                 len(request.get_tokens(0)), num_computed_tokens,
                                                 request)
            return tokens, False             # loaded synchronously in start_load_kv

        def request_finished(self, request, cache_block_ids):
            self.planner.finished(request.request_id)
            return False                     # nothing saved asynchronously: free blocks at once

        def update_state_after_alloc(self, request, block_ids):
            pass                             # block ids arrive through the scheduler output

    class KvholdConnectorWorker(KvCacheConnectorWorker):
        def __init__(self, llm_args):
            super().__init__(llm_args)
            self.executor = MirrorExecutor(current(), *_geometry(llm_args))

        def register_kv_caches(self, kv_cache_tensor):
            self.executor.register(kv_cache_tensor)

        def start_load_kv(self, stream):
            self.executor.load(self._metadata)

        def wait_for_layer_load(self, layer_idx, stream):
            pass

        def save_kv_layer(self, layer_idx, stream):
            pass

        def wait_for_save(self, stream):
            stream.synchronize()             # the forward pass has written the blocks
            self.executor.save(self._metadata)

        def get_finished(self, finished_gen_req_ids, started_loading_req_ids):
            return [], []
