"""Checkpoint manifest: where each weight tensor lives in the file and in the weights region.

Built by the sidecar from the safetensors headers alone (8-byte little-endian
header length, then a JSON map name -> {dtype, shape, data_offsets}), so sizing
the weights region needs neither torch nor reading tensor data. It checks the
checkpoint against its config (every expected tensor present with the expected
shape and a floating dtype; nothing unexpected) and names the file and tensor in
every error. An FP8 checkpoint (ModelSpec.quant) keeps its quantized weights in
float8_e4m3fn and their scales as stored: a quantized weight must be F8_E4M3, every other
tensor (scales included) a wider float type, so the region holds the FP8 bytes and the
layout (dtype, shape, offset of every weight and scale) and the scheme (in the spec's digest)
are both in the fingerprint. The manifest's fingerprint identifies the region layout: an executor
that finds a region sealed with the same fingerprint maps it instead of loading.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path

from kvhold.protocol.model_spec import CheckpointError, ModelSpec

SAFETENSORS_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2),
                      "F64": ("float64", 8), "F8_E4M3": ("float8_e4m3fn", 1)}
FP8 = "F8_E4M3"
MAX_HEADER_BYTES = 100 << 20
REGION_ALIGN = 256
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int          # in the weights region
    nbytes: int
    file: str            # file name inside the checkpoint directory
    file_offset: int     # absolute offset of the data in that file


@dataclass(frozen=True, slots=True)
class Manifest:
    entries: tuple[TensorEntry, ...]
    region_bytes: int
    spec_digest: str

    @property
    def fingerprint(self) -> str:
        layout = [(e.name, e.dtype, list(e.shape), e.offset, e.nbytes) for e in self.entries]
        blob = json.dumps({"layout": layout, "spec": self.spec_digest}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()

    def by_name(self) -> dict[str, TensorEntry]:
        return {e.name: e for e in self.entries}

    def to_wire(self) -> dict:
        return {"entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes, e.file,
                             e.file_offset] for e in self.entries],
                "region_bytes": self.region_bytes, "spec_digest": self.spec_digest}

    @classmethod
    def from_wire(cls, d: dict) -> "Manifest":
        entries = tuple(TensorEntry(str(n), str(dt), tuple(int(s) for s in sh), int(o), int(nb),
                                    str(f), int(fo)) for n, dt, sh, o, nb, f, fo in d["entries"])
        return cls(entries=entries, region_bytes=int(d["region_bytes"]),
                   spec_digest=str(d["spec_digest"]))


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor map, absolute offset of the data section) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{path}: header of {n} bytes is implausible")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + n


def spec_digest(spec: ModelSpec) -> str:
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True, default=str).encode()).hexdigest()


def build_manifest(model_dir: str | Path, spec: ModelSpec) -> Manifest:
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    expected = spec.expected_tensors()
    fp8 = set(spec.fp8_weights())
    found: dict[str, tuple[Path, dict, int]] = {}
    for path in files:
        header, data_start = read_safetensors_header(path)
        size = path.stat().st_size
        for name, info in header.items():
            if name.endswith(IGNORED_SUFFIXES):
                continue
            if name not in expected:
                raise CheckpointError(f"{path.name}: tensor {name!r} is not part of a "
                                      f"{spec.model_type} model with this config")
            if name in found:
                raise CheckpointError(f"{path.name}: tensor {name!r} also in {found[name][0].name}")
            _check_entry(path, name, info, expected[name], data_start, size, name in fp8)
            found[name] = (path, info, data_start)
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"{model_dir}: {len(missing)} tensor(s) missing, first {missing[0]!r}")
    entries, offset = [], 0
    for name in expected:  # config order: deterministic layout
        path, info, data_start = found[name]
        dtype, itemsize = SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        entries.append(TensorEntry(name=name, dtype=dtype, shape=tuple(info["shape"]),
                                   offset=offset, nbytes=end - begin, file=path.name,
                                   file_offset=data_start + begin))
        offset += (end - begin + REGION_ALIGN - 1) // REGION_ALIGN * REGION_ALIGN
    return Manifest(entries=tuple(entries), region_bytes=max(offset, REGION_ALIGN),
                    spec_digest=spec_digest(spec))


def _check_entry(path: Path, name: str, info, want_shape, data_start: int, size: int,
                 fp8: bool = False) -> None:
    where = f"{path.name}: tensor {name!r}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise CheckpointError(f"{where}: malformed header entry")
    if info["dtype"] not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{where}: dtype {info['dtype']} is not a supported float type")
    if fp8 and info["dtype"] != FP8:
        raise CheckpointError(f"{where}: dtype {info['dtype']}, but the config's quantization_config "
                              f"quantizes it: {FP8} expected")
    if not fp8 and info["dtype"] == FP8:
        raise CheckpointError(f"{where}: dtype {FP8}, but the config does not quantize it (no "
                              "quantization_config, or the tensor is not a quantized Linear weight)")
    shape = tuple(info["shape"])
    if shape == (1,) and tuple(want_shape) == ():      # a per-tensor scale stored as [1]
        shape = ()
    if shape != tuple(want_shape):
        raise CheckpointError(f"{where}: shape {list(shape)} does not match the config, "
                              f"which implies {list(want_shape)}")
    begin, end = info["data_offsets"]
    itemsize = SAFETENSORS_DTYPES[info["dtype"]][1]
    count = 1
    for s in shape:
        count *= s
    if end - begin != count * itemsize or begin < 0 or data_start + end > size:
        raise CheckpointError(f"{where}: data offsets [{begin}, {end}) are inconsistent with its "
                              f"shape or the file size (truncated file?)")
