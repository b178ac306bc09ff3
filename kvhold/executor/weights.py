"""Weights in the sidecar's region: load once, seal, map read-only everywhere after.

The designated loader (see kvhold.sidecar.weights_keeper) copies each tensor's bytes from
its safetensors file straight into the region at the offset the manifest gives
(`readinto` on the shared mapping: no intermediate copy), beating its lease per
tensor and showing a progress bar, then makes its own mapping read-only and
reports the manifest fingerprint. Every other executor checks that the region is
sealed with the fingerprint of the manifest it was given and maps it; nothing is
reloaded. A short or unreadable file is an error naming the file and tensor. FP8 weights
(float8_e4m3fn) and their scales are copied and viewed as stored: kvhold.executor.fp8 computes
with them.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kvhold.executor.kv_cache import TORCH_DTYPES
from kvhold.protocol.checkpoint import Manifest
from kvhold.protocol.layout import WeightsState
from kvhold.protocol.memory import Mapping
from kvhold.protocol.model_spec import CheckpointError

log = logging.getLogger(__name__)
# the dtypes of tensors in the region: the compute dtypes and FP8 weights (never a compute dtype)
WEIGHT_DTYPES = {**TORCH_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


class WeightsRegion:
    def __init__(self, mapping: Mapping, manifest: Manifest, model_dir: str | Path):
        if mapping.size < manifest.region_bytes:
            raise ValueError(f"weights region of {mapping.size} bytes < manifest's {manifest.region_bytes}")
        self.mapping = mapping
        self.manifest = manifest
        self.model_dir = Path(model_dir)

    def load(self, beat=lambda: None) -> float:
        """Copy every tensor from disk into the region; returns milliseconds.

        Host regions are filled by reading straight into the shared mapping; device
        regions through a pinned staging buffer, chunk by chunk."""
        t0 = time.monotonic()
        if self.mapping.info.backend == "cuda":
            write = device_writer(self.mapping.tensor(torch.uint8, (self.manifest.region_bytes,)))
        else:
            write = host_writer(self.mapping.numpy(np.uint8, (self.manifest.region_bytes,)))
        copy_checkpoint(self.manifest, self.model_dir, write, beat)
        if self.mapping.info.backend == "cuda":
            torch.cuda.synchronize()
        self.mapping.seal_readonly()
        return (time.monotonic() - t0) * 1e3

    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy views of every tensor, keyed by its Hugging Face name."""
        return {e.name: self.mapping.tensor(WEIGHT_DTYPES[e.dtype], e.shape, e.offset)
                for e in self.manifest.entries}


def copy_checkpoint(manifest: Manifest, model_dir: str | Path, write, beat=lambda: None) -> None:
    """Copy each of the manifest's tensors from its safetensors file, one at a time, with
    `write(file, region_offset, nbytes) -> bytes written` (host_writer, device_writer), beating
    after each, with a progress bar. A short or unreadable file is a CheckpointError naming it."""
    total = sum(e.nbytes for e in manifest.entries)
    files: dict[str, object] = {}
    try:
        with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights", disable=None,
                  mininterval=0.5) as bar:
            for e in manifest.entries:
                f = files.get(e.file)
                if f is None:
                    path = Path(model_dir) / e.file
                    try:
                        f = files[e.file] = open(path, "rb")
                    except OSError as exc:
                        raise CheckpointError(f"{path}: cannot open ({exc.strerror})") from None
                f.seek(e.file_offset)
                got = write(f, e.offset, e.nbytes)
                if got != e.nbytes:
                    raise CheckpointError(f"{e.file}: tensor {e.name!r} truncated ({got} of {e.nbytes} bytes)")
                bar.update(e.nbytes)
                beat()
    finally:
        for f in files.values():
            f.close()


def host_writer(buf: np.ndarray):
    """copy_checkpoint's writer into host memory (uint8): read straight into it."""
    def write(f, offset, nbytes):
        return f.readinto(memoryview(buf[offset:offset + nbytes]))
    return write


def device_writer(dst: torch.Tensor, stage_bytes: int = 256 << 20):
    """copy_checkpoint's writer into device memory (uint8): through a pinned staging buffer."""
    stage = torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=True)
    stage_np = stage.numpy()

    def write(f, offset, nbytes):
        done = 0
        while done < nbytes:
            k = min(stage_bytes, nbytes - done)
            got = f.readinto(memoryview(stage_np[:k]))
            if got != k:
                return done + got
            dst[offset + done:offset + done + k].copy_(stage[:k])  # synchronous: stage reused next
            done += k
        return done
    return write


def wait_until_sealed(tables, fingerprint: str, my_epoch: int, beat, timeout_s: float = 3600.0) -> bool:
    """Wait for another executor to seal the weights. Returns True when sealed, False when
    this executor was designated to load them instead."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = tables.weights_state
        if state == WeightsState.SEALED:
            sealed = tables.weights_fingerprint
            if sealed != fingerprint:
                raise RuntimeError(f"weights sealed with fingerprint {sealed[:12]}, expected {fingerprint[:12]}")
            return True
        if state == WeightsState.LOADING and tables.weights_epoch == my_epoch:
            return False
        beat()
        time.sleep(0.01)
    raise TimeoutError("weights were not sealed in time")
