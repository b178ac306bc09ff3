"""SidecarConfig: every knob of a sidecar and of the executors it supervises.

Built once (kvhold.cli parses flags and environment), validated here, passed down
and never mutated. Executors receive their share as `executor_settings()` in the
attach reply, so one place configures the whole instance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvhold.protocol.layout import KV_DTYPE_CODES, KvGeometry, TableGeometry
from kvhold.protocol.naming import InstancePaths, validate_instance
from kvhold.protocol.settings import ExecutorSettings

WORKLOADS = ("engine", "idle", "churn")
BACKENDS = ("host", "cuda")
TAKEOVER_MODES = ("fast", "wait-exit")
KV_MODES = ("native", "foreign")


def parse_host_port(text: str) -> tuple[str, int]:
    """("HOST", PORT) from "HOST:PORT" or "[V6]:PORT"; port 0 lets the kernel pick."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"--client-tcp wants HOST:PORT (e.g. 127.0.0.1:5555), got {text!r}")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    instance: str = "default"
    runtime_root: Path | None = None
    model: Path | None = None
    backend: str = "host"
    device: str = "cpu"
    workload: str = "engine"          # what executors run: the model, nothing, or a KV churn
    # KV pool
    kv_pages: int | None = None
    kv_memory_bytes: int | None = None
    page_tokens: int = 16
    max_seq_len: int | None = None
    max_requests: int = 256
    # executors
    standbys: int = 1
    lease_ms: int = 1000
    startup_lease_ms: int = 120_000
    kill_fenced: bool = True
    spawn_executors: bool = True
    executor_args: tuple[str, ...] = ()
    max_batch: int = 64
    max_batch_tokens: int = 512
    prefill_chunk: int | None = None
    compute_dtype: str | None = None
    cpu_threads: int | None = None
    # geometry used when there is no model (workload idle/churn)
    synthetic_layers: int = 2
    synthetic_kv_heads: int = 2
    synthetic_head_dim: int = 32
    synthetic_dtype: str = "float32"
    token_file: Path | None = None
    # optional TCP client endpoint ("HOST:PORT"); CurveZMQ unless insecure_tcp
    client_tcp: str | None = None
    curve_secret_key: Path | None = None
    curve_authorized_keys: Path | None = None
    insecure_tcp: bool = False
    restart_backoff_ms: tuple[int, int] = (50, 5000)
    health: str = "auto"              # auto (NVML on CUDA, off on CPU), off, nvml[:N], replay:PATH
    health_interval_s: float = 1.0
    zygote: bool = False              # keep a torch-imported zygote to fork executors from
    takeover: str = "fast"            # fast: promote at once; wait-exit: after the dead process exits
    kv_mode: str = "native"           # foreign: engine keeps a private KV pool, mirrored into kvhold's
    registry: str | None = None       # etcd://HOST:PORT[,HOST:PORT]: register in etcd (kvhold.sidecar.registry)
    service: str = "default"          # registry key prefix /kvhold/<service>/sidecars/
    registry_ttl_s: int = 5           # etcd lease: a dead sidecar's entry vanishes after this
    journal_dir: Path | None = None   # durable request journal (kvhold.sidecar.durable_journal)

    def __post_init__(self):
        validate_instance(self.instance)
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.workload == "engine" and self.model is None:
            raise ValueError("the engine workload needs --model (a Hugging Face checkpoint directory)")
        if self.model is not None and not Path(self.model).is_dir():
            raise ValueError(f"--model {self.model}: not a directory")
        if self.kv_pages is not None and self.kv_pages <= 0:
            raise ValueError(f"--kv-pages must be positive, got {self.kv_pages}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError("--kv-memory must be positive")
        if not 1 <= self.page_tokens <= 1024:
            raise ValueError(f"--page-tokens must be in 1..1024, got {self.page_tokens}")
        if not 0 <= self.standbys <= 8:
            raise ValueError(f"--standbys must be in 0..8, got {self.standbys}")
        lo, hi = self.restart_backoff_ms
        if not 0 <= lo <= hi:
            raise ValueError(f"--restart-backoff-ms needs 0 <= LO <= HI, got {lo},{hi}")
        kind, _, arg = self.health.partition(":")
        if not (self.health in ("auto", "off", "nvml") or (kind == "nvml" and arg.isdigit())
                or (kind == "replay" and arg)):
            raise ValueError(f"--health must be auto, off, nvml, nvml:N or replay:PATH, got {self.health!r}")
        if kind == "replay" and not Path(arg).is_file():
            raise ValueError(f"--health replay:{arg}: no such file")
        if not 0.05 <= self.health_interval_s <= 60:
            raise ValueError(f"--health-interval must be in 0.05..60 s, got {self.health_interval_s}")
        if self.takeover not in TAKEOVER_MODES:
            raise ValueError(f"--takeover must be one of {TAKEOVER_MODES}, got {self.takeover!r}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"--kv-mode must be one of {KV_MODES}, got {self.kv_mode!r}")
        if self.lease_ms < 20:
            raise ValueError(f"--lease-ms must be at least 20, got {self.lease_ms}")
        chunk = self.prefill_chunk or self.max_batch_tokens - self.max_batch
        if self.max_batch < 1 or chunk < 1 or chunk + self.max_batch > self.max_batch_tokens:
            raise ValueError(f"need --prefill-chunk ({chunk}) + --max-batch ({self.max_batch}) <= "
                             f"--max-batch-tokens ({self.max_batch_tokens}), all positive")
        if not 1 <= self.max_requests <= 65536:
            raise ValueError(f"--max-requests must be in 1..65536, got {self.max_requests}")
        if self.synthetic_dtype not in KV_DTYPE_CODES:
            raise ValueError(f"unknown dtype {self.synthetic_dtype!r}")
        if self.compute_dtype is not None and self.compute_dtype not in KV_DTYPE_CODES:
            raise ValueError(f"--compute-dtype must be one of {sorted(KV_DTYPE_CODES)}")
        if not self.device == "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if self.device.startswith("cuda") != (self.backend == "cuda"):
            raise ValueError("--device cuda needs --backend cuda (and cpu needs host): weights and "
                             "KV must live where the engine computes")
        self._validate_tcp()
        self._validate_registry()

    def _validate_registry(self) -> None:
        if self.registry is not None:     # imported only then: the etcd client is not free to load
            from kvhold.routing.registry_client import parse_registry_url, validate_service

            parse_registry_url(self.registry)
            validate_service(self.service)
        if not 2 <= self.registry_ttl_s <= 3600:
            raise ValueError(f"--registry-ttl must be 2..3600 seconds, got {self.registry_ttl_s}")

    def _validate_tcp(self) -> None:
        if self.client_tcp is None:
            if self.curve_secret_key or self.curve_authorized_keys or self.insecure_tcp:
                raise ValueError("--curve-secret-key, --curve-authorized-keys and --insecure-tcp "
                                 "apply to --client-tcp, which is not given")
            return
        parse_host_port(self.client_tcp)
        if self.curve_secret_key is None and not self.insecure_tcp:
            raise ValueError("--client-tcp needs --curve-secret-key FILE (make one with kvhold "
                             "keygen): without CURVE anyone who reaches the port can read and send "
                             "requests; give --insecure-tcp to accept that")
        if self.curve_secret_key is not None and self.insecure_tcp:
            raise ValueError("--insecure-tcp contradicts --curve-secret-key: pick one")
        if self.curve_secret_key is not None and not Path(self.curve_secret_key).is_file():
            raise ValueError(f"--curve-secret-key {self.curve_secret_key}: no such file")
        if self.curve_authorized_keys is not None and self.curve_secret_key is None:
            raise ValueError("--curve-authorized-keys needs --curve-secret-key")
        if self.curve_authorized_keys is not None and not Path(self.curve_authorized_keys).is_dir():
            raise ValueError(f"--curve-authorized-keys {self.curve_authorized_keys}: not a directory")

    @property
    def paths(self) -> InstancePaths:
        return InstancePaths.for_instance(self.instance, self.runtime_root)

    @property
    def journal_path(self) -> Path:
        """Where the durable journal lives: --journal-dir, else a persistent per-instance default."""
        from kvhold.sidecar.durable_journal import default_journal_root
        return Path(self.journal_dir) if self.journal_dir else default_journal_root() / self.instance

    @property
    def client_tcp_address(self) -> tuple[str, int] | None:
        return parse_host_port(self.client_tcp) if self.client_tcp else None

    @property
    def heartbeat_ms(self) -> int:
        """Executors beat this often: a few beats per lease so one late beat is no death."""
        return max(5, self.lease_ms // 5)

    @property
    def num_leases(self) -> int:
        return min(64, 2 * (1 + self.standbys) + 2)

    def compute_dtype_for(self, spec) -> str:
        """Engine arithmetic and KV dtype: float64 on CPU (the exact reference: outputs do not
        depend on batch composition), the checkpoint's dtype on CUDA, unless overridden."""
        if self.compute_dtype:
            return self.compute_dtype
        return spec.dtype if self.device.startswith("cuda") else "float64"

    def kv_geometry(self, spec=None) -> KvGeometry:
        if spec is None:
            return KvGeometry(self.synthetic_layers, self.synthetic_kv_heads, self.synthetic_head_dim,
                              self.synthetic_dtype, self.page_tokens)
        return KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                          self.compute_dtype_for(spec), self.page_tokens)

    def table_geometry(self, spec=None) -> TableGeometry:
        kv = self.kv_geometry(spec)
        max_seq = self.max_seq_len or (min(spec.max_position, 4096) if spec else 2048)
        if spec is not None and max_seq > spec.max_position:
            raise ValueError(f"--max-seq-len {max_seq} exceeds the model's "
                             f"max_position_embeddings ({spec.max_position})")
        if self.kv_pages is not None:
            pages = self.kv_pages
        elif self.kv_memory_bytes is not None:
            pages = self.kv_memory_bytes // kv.page_bytes
        else:  # enough for a handful of full-length sequences
            pages = max(64, 4 * math.ceil(max_seq / kv.page_tokens) + 1)
        if pages - 1 < math.ceil(max_seq / kv.page_tokens):  # page 0 is the reserved null page
            raise ValueError(f"the KV pool ({pages} pages of {kv.page_tokens} tokens, one reserved) "
                             f"cannot hold one sequence of --max-seq-len {max_seq}")
        return TableGeometry(kv=kv, num_pages=pages, num_slots=self.max_requests,
                             max_seq_len=max_seq, num_leases=self.num_leases)

    def executor_settings(self, spec=None) -> ExecutorSettings:
        return ExecutorSettings(
            workload=self.workload, device=self.device, heartbeat_ms=self.heartbeat_ms,
            lease_ms=self.lease_ms, model=str(self.model) if self.model else None,
            max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens,
            prefill_chunk=self.prefill_chunk or None,
            compute_dtype=self.compute_dtype_for(spec) if spec else None,
            cpu_threads=self.cpu_threads or None, kv_mode=self.kv_mode)
