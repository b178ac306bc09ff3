"""TensorRT-LLM KV Cache Connector that mirrors the engine's KV pool into kvhold.

Written against TensorRT-LLM 1.2 (repository NVIDIA/TensorRT-LLM); every fact below was read
in its source at the commit named (b35ac1b6 is the tree whose tensorrt_llm/version.py says
1.2.0rc2; the other commits' versions were not determined):
* tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py (00fdcbff, 32779536): the ABCs
  `KvCacheConnectorScheduler(llm_args)` (`build_connector_meta(scheduler_output)`,
  `get_num_new_matched_tokens(request, num_computed_tokens) -> (int, bool)`: tokens beyond the
  `num_computed_tokens` already matched on the device, `request_finished(request,
  cache_block_ids) -> bool`, `update_state_after_alloc(request, block_ids)`) and
  `KvCacheConnectorWorker(llm_args)` (`register_kv_caches`, `start_load_kv(stream)`,
  `wait_for_layer_load`, `save_kv_layer`, `wait_for_save(stream)`, `get_finished`,
  `bind_connector_meta` -> `self._metadata`); `RequestData(request_id, new_tokens,
  new_block_ids, computed_position, num_scheduled_tokens)`, where a context request's
  `computed_position` is `context_current_position` minus the tokens the connector matched
  in this step and a generation request's is `len(get_tokens(0)) - 1` with one scheduled token.
  Newer trees moved the module to tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py
  (035ab91c): both paths are tried, and a tree with neither fails at import.
* cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp (b35ac1b6): only the block-reuse overload
  of `WindowBlockManager::addSequence` asks the connector
  (`getNumNewMatchedTokens(llmRequest, prepopulatedPromptLen)`, after the radix-tree match
  `loadOrAllocateBlocks`), then `setPrepopulatedPromptLen(reused + matched)`; the overload
  without reuse logs "The KV Cache Connector will be ignored". So block reuse must be on.
  Blocks matched in the radix tree may be shared with other requests; blocks allocated after
  the match (where the connector's tokens go) belong to this request; a partially matched
  block is copied or claimed, so it is private too.
* tensorrt_llm/_torch/pyexecutor/py_executor.py (several stored versions; commit not
  determined): `_maybe_init_kv_connector_manager` calls
  `worker.register_kv_caches(kv_cache_manager.get_unique_primary_pool())` once and hooks every
  `DecoderLayer` (pre: `wait_for_layer_load`, post: `save_kv_layer`); `_kv_connector_start_batch`
  runs `handle_metadata()` (build_connector_meta, bind) then `start_load_kv(current_stream())`;
  `_forward_step` calls `wait_for_save(current_stream())` right after the model's forward, in
  the plain and the overlap loop alike.
* tensorrt_llm/_torch/pyexecutor/resource_manager.py (b35ac1b6): `get_unique_primary_pool()`
  is one tensor for all layers, [blocks, layers, 2, tokens*heads*dim]; `get_buffers(layer)`
  views a layer as [blocks, 2, tokens, heads, dim] (NHD), what the VANILLA backend reads and
  writes. Newer trees add `get_buffers(layer, kv_layout="NHD"|"HND")`: "different attention
  backend/implementation can have different KV layouts". The KV cache manager's own
  partial-block copy (cpp/tensorrt_llm/kernels/kvCachePartialCopy.cu, a90a0166) indexes a
  block as (head * tokensPerBlock + token) * headDim + d: HND, the TRTLLM backend's layout.
  The launcher picks the layout from `attn_backend` (launcher.kv_layout).

How it protects the engine. After each forward pass (`wait_for_save`, stream synchronized)
the worker mirrors the rows the pass wrote (kvhold.executor.kv_mirror: versioned, checksummed
pages), before the step's tokens reach the launcher and the journal. A request's first pass
also mirrors its prefix that came from the radix tree (the kvhold page of a block belongs to
one request even where the engine shares the block). After a takeover the launcher
validates the mirrored pages (`KvMirror.plan_restore`, full blocks only) and resubmits every
journaled request; `get_num_new_matched_tokens` reports the intact full blocks beyond what
the radix tree already matched, counted from `num_computed_tokens`, and `start_load_kv`
copies them into the blocks TensorRT-LLM allocated. What was loaded is counted when the
copy is made (`Bridge.outcomes`), and only that is reported as kept.

Under the overlap scheduler (TensorRT-LLM's default) a generation request's
`computed_position` is one token behind the row the pass writes: the mirror then claims,
after each pass, the row the previous pass wrote, never a row not yet written; it lags one
token, which a takeover recomputes.

The scheduler and the worker share one `Bridge` installed by the launcher in this process
(TP=1, `TLLM_WORKER_USE_SINGLE_PROCESS=1`). The logic lives in `MirrorPlanner` and
`MirrorExecutor` (no TensorRT-LLM types: tested on CPU); the connector classes are thin.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from kvhold.executor.block_layout import PooledBlocks
from kvhold.executor.engine_bridge import Installed
from kvhold.executor.kv_mirror import Committed, KvMirror

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What the engine did with one resubmitted kvhold request's prefix after a takeover."""

    covered: int = 0        # prompt tokens the engine did not compute: radix-tree hits + loaded
    loaded: int = 0         # of which loaded from kvhold pages (counted when the copy is made)
    settled: bool = False   # the connector has answered for it and any load has been made


@dataclass
class Bridge:
    """What the launcher shares with the connector: kvhold's tables, pool and lease, request ids."""

    tables: object
    kv_pool: object                          # kvhold's KV region [pages, L, 2, T, H, D]
    lease: object
    head_major: bool = True                  # blocks are [heads][tokens][dim] (HND), else NHD
    client_ids: dict[int, int] = field(default_factory=dict)   # LLM API client id -> kvhold id
    expected: dict[tuple, list[int]] = field(default_factory=dict)  # submitted tokens -> kvhold ids
    restorable: dict[int, tuple[int, ...]] = field(default_factory=dict)  # kvhold id -> pages
    outcomes: dict[int, Outcome] = field(default_factory=dict)   # kvhold id -> after a takeover
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

    # ---------------------------------------------------------------- takeover bookkeeping
    def await_outcomes(self, kvhold_ids) -> None:
        """The launcher resubmits these after a takeover: their outcome is to be reported."""
        with self.lock:
            for rid in kvhold_ids:
                self.outcomes[int(rid)] = Outcome()

    def unsettled(self) -> list[int]:
        with self.lock:
            return [rid for rid, o in self.outcomes.items() if not o.settled]

    def _matched(self, kvhold_id, computed: int, matched: int) -> None:
        o = self.outcomes.get(kvhold_id)
        if o is not None and not o.settled:
            o.covered = computed + matched
            o.settled = matched == 0         # otherwise once the load is made

    def _loaded(self, kvhold_id: int, tokens: int) -> None:
        o = self.outcomes.get(kvhold_id)
        if o is not None:
            o.loaded += tokens
            o.settled = True

    def _finished(self, kvhold_id) -> None:
        o = self.outcomes.get(kvhold_id)
        if o is not None and not o.settled:
            o.covered = o.loaded             # finished (or aborted) before its load was made
            o.settled = True


_INSTALLED: Installed[Bridge] = Installed(
    "no kvhold bridge installed: run TensorRT-LLM through kvhold.trtllm_bridge.launcher")
install = _INSTALLED.install          # the workload's, before the engine is built
current = _INSTALLED.current          # the connector classes', from inside the engine


@dataclass
class Load:
    kvhold_id: int
    tokens: int                              # prompt tokens these pages give the request
    pages: list[int]
    blocks: list[int]


@dataclass
class ConnectorMeta:
    save: list[Committed] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)

    @property
    def load_pages(self) -> list[int]:
        return [p for ld in self.loads for p in ld.pages]

    @property
    def load_blocks(self) -> list[int]:
        return [b for ld in self.loads for b in ld.blocks]


@dataclass
class _Tracked:
    kvhold_id: int | None
    request: object = None                   # the engine's LlmRequest, to resolve kvhold_id later
    blocks: list[int] = field(default_factory=list)
    first_block: int = 0                     # first logical block the connector loads
    load_blocks: int = 0                     # how many
    matched: int = 0                         # tokens reported to TensorRT-LLM as matched


class MirrorPlanner:
    """Scheduler side: which blocks to load before, and to mirror after, each forward pass."""

    def __init__(self, bridge: Bridge, block_tokens: int):
        self.bridge, self.block_tokens = bridge, block_tokens
        self.tracked: dict[int, _Tracked] = {}
        self.warned = False

    def matched_tokens(self, request_id: int, kvhold_id: int | None, num_prompt: int,
                       num_computed: int, request=None) -> int:
        """Tokens beyond the `num_computed` that the device already has (radix-tree hits) that
        kvhold can load: up to the end of the last intact full block, leaving at least one
        prompt token for the engine to compute (TensorRT-LLM requires prepopulated < prompt).

        Counted from `num_computed`, which need not fall on a block boundary (partial reuse):
        the block holding it is private to the request then, and is loaded whole."""
        bt = self.block_tokens
        pages = self.bridge.restorable.get(kvhold_id, ()) if kvhold_id else ()
        usable = min(len(pages), max(0, num_prompt - 1) // bt)
        matched = max(0, usable * bt - num_computed)
        first = num_computed // bt
        self.tracked[request_id] = _Tracked(kvhold_id, request, first_block=first,
                                            load_blocks=usable - first if matched else 0, matched=matched)
        with self.bridge.lock:
            self.bridge._matched(kvhold_id, num_computed, matched)
        return matched

    def build(self, new_requests, cached_requests) -> ConnectorMeta:
        meta = ConnectorMeta()
        for data in new_requests:
            if data.request_id not in self.tracked and not self.warned:
                self.warned = True           # its kvhold id can never be resolved: nothing mirrored
                log.error("request %s was scheduled without get_num_new_matched_tokens: is "
                          "kv_cache_config.enable_block_reuse off? Its KV is not mirrored", data.request_id)
            t = self.tracked.setdefault(data.request_id, _Tracked(None))
            t.blocks.extend(data.new_block_ids)
            start = data.computed_position   # TensorRT-LLM subtracted the connector's tokens
            if t.load_blocks and t.kvhold_id:
                self._load(meta, t)
                start += t.matched
            # a request's first pass also mirrors the prefix it got from the radix tree
            self._save(meta, t, 0, start + data.num_scheduled_tokens)
        for data in cached_requests:
            t = self.tracked.setdefault(data.request_id, _Tracked(None))
            t.blocks.extend(data.new_block_ids)
            self._save(meta, t, data.computed_position, data.num_scheduled_tokens)
        return meta

    def _load(self, meta: ConnectorMeta, t: _Tracked) -> None:
        pages = self.bridge.restorable.pop(t.kvhold_id, ())
        span = range(t.first_block, t.first_block + t.load_blocks)
        meta.loads.append(Load(t.kvhold_id, t.matched, [pages[i] for i in span], [t.blocks[i] for i in span]))
        t.load_blocks = 0

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
        t = self.tracked.pop(request_id, None)
        if t is not None and t.kvhold_id:
            with self.bridge.lock:
                self.bridge._finished(t.kvhold_id)


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
        """Copy the planned pages into the engine's blocks; what is copied is what counts as kept."""
        if meta is None or not meta.loads:
            return
        with self.bridge.lock:
            self.bridge.mirror.load(meta.load_pages, meta.load_blocks, self.layout)
            for ld in meta.loads:
                self.bridge._loaded(ld.kvhold_id, ld.tokens)

    def save(self, meta: ConnectorMeta | None) -> int:
        if meta is None or not meta.save:
            return 0
        with self.bridge.lock:
            return self.bridge.mirror.mirror_committed(meta.save)


# Where TensorRT-LLM keeps the connector ABCs: 1.2 first, then the newer package.
CONNECTOR_MODULES = ("tensorrt_llm._torch.pyexecutor.kv_cache_connector",
                     "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector")


def connector_bases() -> tuple[type, type]:
    """(KvCacheConnectorScheduler, KvCacheConnectorWorker) of the installed TensorRT-LLM.

    Raises ImportError naming every path tried and why each failed: a TensorRT-LLM without
    either module must fail here, at import, not later when its executor looks the kvhold
    classes up."""
    import importlib

    errors = []
    for name in CONNECTOR_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            errors.append(f"{name}: {e}")
            continue
        try:
            return module.KvCacheConnectorScheduler, module.KvCacheConnectorWorker
        except AttributeError as e:
            errors.append(f"{name}: {e}")
    raise ImportError("no TensorRT-LLM KV cache connector API found; tried " + "; ".join(errors))


def _tensorrt_llm_present() -> bool:
    import importlib.util
    import sys

    return "tensorrt_llm" in sys.modules or importlib.util.find_spec("tensorrt_llm") is not None


def _geometry(llm_args) -> tuple[int, int, int]:
    bridge = current()
    kv = bridge.tables.geometry.kv
    tokens = llm_args.kv_cache_config.tokens_per_block
    if tokens != kv.page_tokens:
        raise ValueError(f"kv_cache_config.tokens_per_block={tokens}, kvhold pages hold {kv.page_tokens}")
    return tokens, kv.num_kv_heads, kv.head_dim


def _define_connector_classes():
    KvCacheConnectorScheduler, KvCacheConnectorWorker = connector_bases()

    class KvholdConnectorScheduler(KvCacheConnectorScheduler):
        def __init__(self, llm_args):
            super().__init__(llm_args)
            self.planner = MirrorPlanner(current(), _geometry(llm_args)[0])

        def build_connector_meta(self, scheduler_output):
            return self.planner.build(scheduler_output.new_requests, scheduler_output.cached_requests)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            prompt = getattr(request, "prompt_len", None) or len(request.get_tokens(0))
            tokens = self.planner.matched_tokens(request.request_id, current().kvhold_id(request),
                                                 int(prompt), num_computed_tokens, request)
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

    return KvholdConnectorScheduler, KvholdConnectorWorker


_MISSING = None
if _tensorrt_llm_present():                  # TensorRT-LLM is installed: its API must be found
    KvholdConnectorScheduler, KvholdConnectorWorker = _define_connector_classes()
else:
    _MISSING = "tensorrt_llm is not installed"


def __getattr__(name):                       # the classes TensorRT-LLM looks up, where it is absent
    if name in ("KvholdConnectorScheduler", "KvholdConnectorWorker") and _MISSING:
        raise ImportError(f"kvhold.trtllm_bridge.trtllm_connector.{name} needs TensorRT-LLM: {_MISSING}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
