"""An engine outside any sidecar, for benchmarks that measure the engine itself.

Creates a private tables segment and lease, loads a checkpoint straight onto the
device (no kvhold region), and returns an Engine with the device's runner and
checksum. With `commit=False` the engine commits through NoCommit
(kvhold.executor.commit: the engine advances, nothing is published) and the CUDA runner
hashes no slots: the baseline the commit protocol's cost is measured against. `admit`
writes requests into the journal the way the sidecar does.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from kvhold.executor.commit import CommitProtocol, NoCommit
from kvhold.executor.engine import Engine
from kvhold.executor.kv_cache import TORCH_DTYPES, KvCache
from kvhold.executor.llama import LlamaModel
from kvhold.executor.weights import WEIGHT_DTYPES, copy_checkpoint, device_writer, host_writer
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.leases import Lease, LeaseTable
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.sampling import SamplingParams
from kvhold.protocol.tables import Tables


def load_weights(model_dir: Path, device: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors laid out as in the sidecar's weights region: one buffer,
    tensors at their manifest offsets (config order), so fused projections are views. Read
    tensor by tensor as the sidecar's loader reads them (kvhold.executor.weights.copy_checkpoint),
    so the device holds the region alone (a 70B FP8 checkpoint beside it would not fit an H200)."""
    manifest = build_manifest(model_dir, ModelSpec.from_dir(model_dir))
    region = torch.empty(manifest.region_bytes, dtype=torch.uint8, device=device)
    cuda = region.is_cuda
    copy_checkpoint(manifest, model_dir, device_writer(region) if cuda else host_writer(region.numpy()))
    if cuda:
        torch.cuda.synchronize()
    return {e.name: region[e.offset:e.offset + e.nbytes].view(WEIGHT_DTYPES[e.dtype]).view(e.shape)
            for e in manifest.entries}


def build_engine(model_dir: Path, device: str, kv_pages: int, max_seq_len: int, max_batch: int,
                 max_batch_tokens: int, prefill_chunk: int, commit: bool = True, weights=None,
                 use_graph: bool = True, timeline: dict | None = None, exact_prefill: bool = False,
                 prefix_salt: bytes | None = None):
    """`prefix_salt`: with a prefix cache (Engine's argument), None: without."""
    timeline = timeline if timeline is not None else {}
    spec = ModelSpec.from_dir(model_dir)
    dev = torch.device(device)
    dtype = spec.dtype if dev.type == "cuda" else "float64"
    weights = weights if weights is not None else load_weights(model_dir, device)
    timeline["weights_loaded"] = time.monotonic()
    geometry = TableGeometry(kv=KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, dtype, 16),
                             num_pages=kv_pages, num_slots=256, max_seq_len=max_seq_len, num_leases=2)
    tables = Tables.create(f"/kvhold-bench-{os.getpid()}-{time.monotonic_ns()}", geometry, 1)
    leases = LeaseTable(tables)
    epoch = leases.grant(0, os.getpid())
    lease = Lease(tables, 0, epoch)
    kv = KvCache.private(geometry.kv, kv_pages, dev)
    timeline["kv_allocated"] = time.monotonic()
    model = LlamaModel(spec, weights, TORCH_DTYPES[dtype], dev, max_seq_len)
    runner = checksum = None
    if dev.type == "cuda":
        from kvhold.executor.cuda.checksum import TritonChecksum
        from kvhold.executor.cuda.runner import CudaRunner

        runner = CudaRunner(model, kv, max_batch, prefill_chunk, geometry.max_pages_per_seq, use_graph,
                            slot_hashes=commit, exact=exact_prefill)
        runner.prepare()
        checksum = TritonChecksum(kv.pool)
    timeline["graphs_captured"] = time.monotonic()
    engine = Engine(model, kv, tables, lease, max_batch, max_batch_tokens, runner=runner,
                    checksum=checksum, prefill_chunk=prefill_chunk,
                    protocol=CommitProtocol if commit else NoCommit, prefix_salt=prefix_salt)
    engine.take_over([], 0)              # empty journal: builds the free list
    return engine, tables


def admit(tables: Tables, requests: list[dict], slots: list[int] | None = None) -> list[int]:
    """Request ids, in order; `slots`, if given, gets each one's journal slot."""
    journal = Journal(tables)
    ids = []
    for r in requests:
        slot = journal.free_slot()
        if slot is None:
            raise RuntimeError("no free journal slot")
        if slots is not None:
            slots.append(slot)
        tables.header["request_counter"] += 1
        rid = (1 << 40) | int(tables.header["request_counter"])
        fields = {k: v for k, v in r.items() if k in SamplingParams.__dataclass_fields__}
        fields = {"seed": 0, "temperature": 0.0, "ignore_eos": True, **fields,
                  "stop_token_ids": tuple(r.get("stop_token_ids", ()))}
        journal.admit(slot, rid, r["prompt_ids"], SamplingParams(**fields))
        ids.append(rid)
    return ids
