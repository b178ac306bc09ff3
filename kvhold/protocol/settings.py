"""ExecutorSettings: what the sidecar tells each executor to run, and how.

The sidecar builds one value (kvhold.sidecar.config: `SidecarConfig.executor_settings()`)
and sends it in every `Attached` reply (kvhold.protocol.messages) as a nested wire value
(kvhold.protocol.wire.nested: a map of its fields, each checked against its declared
type on decode). Every field is named and typed; `None` means "not set: the executor
picks its default". A value is checked when it is made, so a decoded one is as valid as
a built one: a value of the wrong type or out of range raises a `TypeError` or
`ValueError` that names the field (the wire decoder turns it into a BAD_FIELD error).
Missing fields take their defaults. `to_wire`/`from_wire` give the same map for JSON
(the zygote's command line), with the same checks.

`KernelShapesRequest` is the zygote's form of the same settings: the settings plus
the pool's table geometry, as JSON on its command line (kvhold.executor.cuda.kernel_shapes).
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass

from kvhold.protocol.layout import KV_DTYPE_CODES, KvGeometry, TableGeometry
from kvhold.protocol.wire import from_map, nested, to_map

WORKLOADS = ("engine", "idle", "churn", "vllm", "trtllm")   # vllm: kvhold.vllm_bridge; trtllm: kvhold.trtllm_bridge
# sampling fields (kvhold.protocol.sampling.SamplingParams) a workload's engine cannot honour:
# a request that sets one is refused at admission (INVALID_PARAMS), and by the bridge itself
# what an engine bridge cannot honour exactly across a takeover: its engine's own min_tokens
# masks stops that are not kvhold's, and its penalties, min_p, grammars and logit_bias are not restored from kvhold's
# journal (refused at admission)
BRIDGE_UNSUPPORTED = ("min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                      "structured", "logit_bias")
# the TensorRT-LLM launcher also neither asks TensorRT-LLM for log-probs nor journals them
TRTLLM_UNSUPPORTED = BRIDGE_UNSUPPORTED + ("logprobs", "prompt_logprobs")
UNSUPPORTED_SAMPLING = {"vllm": BRIDGE_UNSUPPORTED, "trtllm": TRTLLM_UNSUPPORTED}
KV_MODES = ("native", "foreign")


@nested
class ExecutorSettings:
    workload: str = "engine"          # engine (the model), idle (nothing), churn (synthetic KV), vllm, trtllm
    device: str = "cpu"               # cpu or cuda[:N]
    heartbeat_ms: int = 200           # beat this often
    lease_ms: int = 1000              # a lease not renewed for this long is fenced
    model: str | None = None          # Hugging Face checkpoint directory (engine workload)
    max_batch: int = 64               # sequences per step
    max_batch_tokens: int = 512       # tokens per step
    prefill_chunk: int | None = None  # prompt tokens per step; None: the engine's default
    compute_dtype: str | None = None  # engine arithmetic and KV dtype; None: no model
    cpu_threads: int | None = None    # torch threads on CPU; None: half the cores
    kv_mode: str = "native"           # foreign: the engine keeps a private pool, mirrored
    cuda_graph: bool = True           # capture the decode step in a CUDA graph (CUDA only)
    exact_prefill: bool = True        # CUDA prefill rows on the decode kernels (kvhold.executor.cuda.runner)
    sidecar_wait_ms: int = 30_000     # a sidecar that dies: wait this long for one to re-adopt (0: exit)
    tensor_parallel_size: int = 1     # ranks of the executor group (kvhold.executor.tensor_parallel.ranks)
    prefix_caching: bool = False      # share full KV pages by prompt (kvhold.executor.prefix_cache)
    vllm_any_version: bool = False    # the vllm workload runs a vLLM it was not verified against

    def __post_init__(self):
        for name, allowed in _FIELD_TYPES.items():
            value = getattr(self, name)
            if type(value) not in allowed:
                names = " or ".join("None" if t is type(None) else t.__name__ for t in allowed)
                raise TypeError(f"executor settings: {name} must be {names}, got "
                                f"{type(value).__name__}")
        self._check_values()

    def _check_values(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"executor settings: workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"executor settings: kv_mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"executor settings: device must be cpu or cuda[:N], got {self.device!r}")
        if self.compute_dtype is not None and self.compute_dtype not in KV_DTYPE_CODES:
            raise ValueError(f"executor settings: compute_dtype {self.compute_dtype!r} not one of "
                             f"{sorted(KV_DTYPE_CODES)}")
        for name in ("heartbeat_ms", "lease_ms", "max_batch", "max_batch_tokens", "prefill_chunk",
                     "cpu_threads", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"executor settings: {name} must be positive, got {value}")
        if self.sidecar_wait_ms < 0:
            raise ValueError(f"executor settings: sidecar_wait_ms must be >= 0, got {self.sidecar_wait_ms}")

    def to_wire(self) -> dict:
        return to_map(self)

    @classmethod
    def from_wire(cls, body) -> "ExecutorSettings":
        """From `to_wire`'s map (e.g. decoded JSON), checked as the wire decoder checks it."""
        return from_map(cls, body)


def _allowed_types(tp) -> tuple[type, ...]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


_FIELD_TYPES = {name: _allowed_types(tp) for name, tp in typing.get_type_hints(ExecutorSettings).items()}


@dataclass(frozen=True, slots=True)
class KernelShapesRequest:
    """The executors' settings and the pool's geometry: what the zygote compiles kernels for."""

    settings: ExecutorSettings
    geometry: TableGeometry

    def to_json(self) -> str:
        return json.dumps({"settings": self.settings.to_wire(),
                           "geometry": dataclasses.asdict(self.geometry)})

    @classmethod
    def from_wire(cls, data) -> "KernelShapesRequest":
        """From `to_json`'s decoded object; TypeError or ValueError when it is not one."""
        if not isinstance(data, dict) or set(data) != {"settings", "geometry"}:
            raise ValueError("kernel shapes request: expected an object of settings and geometry")
        geometry = data["geometry"]
        if not isinstance(geometry, dict) or not isinstance(geometry.get("kv"), dict):
            raise ValueError("kernel shapes request: geometry must be an object with a kv object")
        kv = KvGeometry(**geometry["kv"])
        return cls(ExecutorSettings.from_wire(data["settings"]),
                   TableGeometry(**{**geometry, "kv": kv}))
