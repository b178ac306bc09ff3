"""The sidecar's command-line flags and their environment variables, and the SidecarConfig they build.

`kvhold sidecar` and `kvhold serve` (which starts a sidecar) both take these; the
`--instance`/`--runtime-root` pair names a sidecar for every other subcommand too.
`sidecar_config_from_args` maps the flags onto the config's sections
(kvhold.sidecar.config); a section's `SettingError` comes out as a ValueError whose
message names the flags (`FLAGS`) instead of the settings.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from kvhold.protocol.settings import WORKLOADS

_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]?i?B?)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 2**10, "M": 1e6, "MB": 1e6, "MIB": 2**20,
          "G": 1e9, "GB": 1e9, "GIB": 2**30, "T": 1e12, "TB": 1e12, "TIB": 2**40}


def parse_size(text: str) -> int:
    match = _SIZE_RE.match(text)
    if not match or (match.group(2) or "").upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB, 2GiB)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def parse_pair(text: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} wants two integers LO,HI, got {text!r}") from None
    return lo, hi


def env(name: str, default=None):
    return os.environ.get(f"KVHOLD_{name}", default)


def add_instance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", default=env("INSTANCE", "default"),
                   help="instance name; two sidecars on one host need different names "
                        "(env KVHOLD_INSTANCE, default %(default)s)")
    p.add_argument("--runtime-root", type=Path, default=None,
                   help="directory for sockets and the token (env KVHOLD_RUNTIME_DIR, default "
                        "$XDG_RUNTIME_DIR/kvhold or /tmp/kvhold-<uid>)")
    add_log_level_arg(p)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
VLLM_DTYPES = {"auto": None, "half": "float16", "float16": "float16", "bfloat16": "bfloat16",
               "float": "float32", "float32": "float32", "float64": "float64"}


def add_log_level_arg(p: argparse.ArgumentParser, default: str = "INFO") -> None:
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=env("LOG_LEVEL", default),
                   metavar="LEVEL", help=f"least severe log messages shown: {', '.join(LOG_LEVELS)} "
                                         f"(env KVHOLD_LOG_LEVEL, default %(default)s)")


def parse_dtype(text: str) -> str | None:
    """A compute dtype by kvhold's or vLLM's name (--dtype auto: the default)."""
    try:
        return VLLM_DTYPES[text.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: one of {', '.join(VLLM_DTYPES)}") from None


def parse_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def add_sidecar_args(p: argparse.ArgumentParser) -> None:
    add_instance_args(p)
    p.add_argument("--model", type=Path, default=env("MODEL"),
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--device", default=env("DEVICE", "cpu"), help="executor device: cpu or cuda:N")
    p.add_argument("--backend", default="host", choices=("host", "cuda"),
                   help="memory backend: host (POSIX shm) or cuda (VMM, needs a GPU)")
    p.add_argument("--workload", default=None, choices=WORKLOADS,
                   help="what executors run (default: engine with --model, idle without; vllm: a vLLM "
                        "engine, docs/VLLM_BRIDGE.md; trtllm: TensorRT-LLM launchers that attach with "
                        "--no-spawn, whose unsupported request fields are refused at admission, "
                        "docs/TRTLLM_BRIDGE.md)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-pages", type=int, default=None, help="KV pool size in pages")
    kv.add_argument("--kv-memory", type=parse_size, default=None, help="KV pool size, e.g. 2GiB")
    kv.add_argument("--gpu-memory-utilization", type=parse_fraction, default=None, metavar="FRACTION",
                    help="size the KV pool from the GPU instead (CUDA only): this share of its memory, "
                         "less the weights and a 3 GiB reserve per executor (active and standbys), "
                         "as vLLM's flag of the same name")
    p.add_argument("--page-tokens", "--block-size", dest="page_tokens", type=int, default=16,
                   help="tokens per KV page (vLLM's --block-size) (default 16)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="ranks one model is split across (vLLM's name; default 1). Checked against the "
                        "model (heads, KV heads and MLP width divide by N); N > 1 runs each executor as "
                        "a group of N rank processes joined by gloo, on --device cpu only (CUDA needs "
                        "NCCL, not built yet); docs/ARCHITECTURE.md, \"Tensor-parallel groups\"")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=None,
                   help="longest sequence (prompt + output); default min(model context, 4096) "
                        "(--max-model-len: vLLM's name)")
    p.add_argument("--max-requests", type=int, default=256, help="journal slots (default 256)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most top log-probs a request may ask for per token (logprobs, top_logprobs, "
                        "prompt_logprobs), as vLLM's flag (the engine and vllm workloads; the vllm "
                        "workload passes it to vLLM); sizes the journal's logprob area, "
                        "max-requests x max-seq-len x (8 + 8 x this) bytes; 0: no log-probs "
                        "(default 20)")
    p.add_argument("--max-grammar-bytes", type=parse_size, default=65536,
                   help="largest structured-output spec a request may carry (response_format's JSON "
                        "schema, guided_json, guided_regex, guided_choice, guided_grammar), in UTF-8 "
                        "bytes; sizes the journal's extras area, max-requests x about this many bytes; "
                        "0: structured output is refused (default 64 KiB)")
    p.add_argument("--max-prompt-bytes", type=parse_size, default=1 << 20,
                   help="largest text prompt accepted, in UTF-8 bytes, checked before tokenizing; a "
                        "larger one is refused (HTTP 413) (default 1MiB, at most 6MiB)")
    p.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=64,
                   help="most sequences in one step (vLLM's --max-num-seqs) (default %(default)s)")
    p.add_argument("--max-batch-tokens", "--max-num-batched-tokens", dest="max_batch_tokens", type=int, default=512,
                   help="most tokens in one step (vLLM's --max-num-batched-tokens): running decodes go "
                        "first and prefill chunks share the rest, so this bounds how long a prompt can "
                        "hold the streams already decoding; a larger budget prefills faster (default 512)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per sequence per step; chunks are cut at fixed positions "
                        "(default: --max-batch-tokens minus --max-batch; on CUDA at most 2048 with exact "
                        "prefill, 512 without)")
    p.add_argument("--compute-dtype", "--dtype", dest="compute_dtype", type=parse_dtype, default=None,
                   metavar="DTYPE",
                   help="engine arithmetic and KV dtype: float64, float32, bfloat16, float16, or vLLM's "
                        "names (auto, half, float) (default auto: float64 on CPU, the checkpoint's on CUDA)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads per executor on CPU")
    p.add_argument("--standbys", type=int, default=1, help="hot standby executors (default 1)")
    p.add_argument("--lease-ms", type=int, default=1000,
                   help="heartbeat lease: an executor silent this long is fenced (default 1000)")
    p.add_argument("--startup-lease-ms", type=int, default=120_000,
                   help="lease while an executor starts and loads weights (default 120000)")
    p.add_argument("--sidecar-wait-ms", type=int, default=30_000,
                   help="how long executors outlive a sidecar that dies (SIGKILL, a crash), waiting "
                        "for a restarted sidecar of the instance to re-adopt them with their memory; "
                        "a restarted sidecar waits as long for one to hand back the regions' "
                        "descriptors, then makes a fresh pool; 0: they exit with it (default 30000)")
    p.add_argument("--restart-backoff-ms", default="50,5000",
                   help="after 3 executor deaths within a minute, wait LO*2^k ms (at most HI) before "
                        "each re-spawn (default 50,5000; 0,0 disables)")
    p.add_argument("--health", default=env("HEALTH", "auto"),
                   help="GPU health source: auto (NVML on a CUDA device, off on CPU), off, nvml, "
                        "nvml:N, or replay:FILE (a recorded signal sequence, for drills and tests). "
                        "Xid/ECC/row-remap/PCIe/GPU-lost signals restart the executor, close "
                        "admissions for a pool restart, or drain (env KVHOLD_HEALTH)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health polls (default 1.0)")
    p.add_argument("--zygote", action=argparse.BooleanOptionalAction,
                   default={"1": True, "0": False}.get(env("ZYGOTE", "")),
                   help="keep a zygote (torch imported, no CUDA context) and fork executors from it "
                        "instead of starting them cold: a replacement then starts in a fraction of "
                        "the time and CPU. Default: on for the engine workload on CPU with "
                        "--tensor-parallel-size 1, off elsewhere (on CUDA it keeps a spare with a "
                        "context of its own, see --zygote-spare) (env KVHOLD_ZYGOTE=1 or 0)")
    p.add_argument("--zygote-spare", default="auto", choices=("auto", "on", "off"),
                   help="the zygote keeps one child forked ahead, its CUDA context made and its "
                        "kernels and the sampler's loaded, and hands it the next request: a replacement "
                        "then skips that part of its start (costs the spare's context, about 0.5 GiB "
                        "of GPU memory); auto: on for a CUDA device (default)")
    p.add_argument("--takeover", default="fast", choices=("fast", "wait-exit"),
                   help="fast: promote a standby as soon as the active dies, continuing in fresh "
                        "copies of the pages it could still write; wait-exit: promote only once the "
                        "dead process has fully exited (its GPU context torn down; ~100 ms on an H200)")
    p.add_argument("--kv-mode", default="native", choices=("native", "foreign"),
                   help="native: the engine computes in kvhold's KV pages; foreign: it keeps a "
                        "private KV pool (as TensorRT-LLM does) protected by the KV mirror")
    p.add_argument("--enable-prefix-caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="share full KV pages between requests whose prompts begin alike (a system "
                        "prompt, a conversation so far): a request starts after the pages it finds, "
                        "kept in the shared tables through executor and sidecar crashes; idle ones "
                        "are evicted least recently used first. Default: on for the engine workload "
                        "with --kv-mode native and one executor per group and for the vllm workload "
                        "(vLLM's own prefix caching, its cached blocks on shared kvhold pages), off "
                        "elsewhere (asking for it there is an error); --no-enable-prefix-caching "
                        "turns it off")
    p.add_argument("--exact-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="CUDA: prefill on the decode kernels instead of cuBLAS and SDPA, so that a "
                        "recomputed request (preemption, damaged pages, a pool restart) gives the tokens "
                        "of an uninterrupted run even where bf16 rounding tips a near-tie (on by default; "
                        "where the decode step is not on the batch-invariant kernels the executor logs why "
                        "and prefills on cuBLAS). --no-exact-prefill: cuBLAS and SDPA, faster prefill "
                        "(docs/BENCHMARKS.md gives the cost on the H200); the CPU engine is exact either way")
    p.add_argument("--enforce-eager", dest="cuda_graph", action="store_false",
                   help="CUDA: run the decode step eagerly, without capturing it in a CUDA graph (vLLM's name)")
    p.add_argument("--vllm-any-version", action="store_true",
                   help="the vllm workload: run a vLLM version the bridge was not verified against "
                        "(kvhold.vllm_bridge.VERIFIED_VLLM; by default the sidecar refuses it at startup "
                        "and the executor before it builds vLLM's engine, naming both), with a warning in "
                        "the executor's log; for the brave: the KV layout and scheduler hooks it relies on "
                        "may differ")
    p.add_argument("--seed", type=int, default=None,
                   help="draw the seeds of requests that give none from this seed, so that a server "
                        "started again serves the same request order the same way (vLLM's --seed); "
                        "default: each such request gets a random seed. Either way the seed is "
                        "journaled, and a request continues exactly across crashes")
    _add_vllm_flags(p)
    p.add_argument("--no-kill-fenced", dest="kill_fenced", action="store_false",
                   help="fence hung executors without SIGKILLing them")
    p.add_argument("--no-spawn", dest="spawn_executors", action="store_false",
                   help="do not spawn executors; wait for external ones to attach")
    p.add_argument("--token-file", type=Path, default=None,
                   help="executor token file (0600); default: a fresh token in the runtime dir")
    p.add_argument("--journal-dir", type=Path, default=env("JOURNAL_DIR"),
                   help="durable request journal for pool restarts, on local disk (env "
                        "KVHOLD_JOURNAL_DIR; default STATE/journal/INSTANCE, STATE being "
                        "$KVHOLD_STATE_DIR, systemd's $STATE_DIRECTORY, /var/lib/kvhold as root, "
                        "else $XDG_STATE_HOME/kvhold)")
    p.add_argument("--unclaimed-cancel-s", type=float, default=30.0,
                   help="cancel a request whose stream has waited this many seconds for its client "
                        "to reconnect and resume it (freeing its KV); 0: never (default %(default)s)")
    p.add_argument("--stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="log a stats line (prompt and generation throughput, running and waiting "
                        "requests, KV pages in use) this often while there is work; 0: never "
                        "(default %(default)s)")
    p.add_argument("--disable-log-stats", dest="stats_interval", action="store_const", const=0.0,
                   help="no stats line (--stats-interval 0; vLLM's name)")
    add_tcp_args(p)
    add_registry_args(p)


def add_registry_args(p: argparse.ArgumentParser, ttl: bool = True) -> None:
    p.add_argument("--registry", metavar="etcd://HOST:PORT[,HOST:PORT]", default=env("REGISTRY"),
                   help="register this sidecar in etcd (node, GPU, model, generation, health, load) "
                        "under a lease, so routers find it and move requests off it when it dies "
                        "(env KVHOLD_REGISTRY)" if ttl else
                        "the etcd cluster the sidecars register in (env KVHOLD_REGISTRY)")
    p.add_argument("--service", default=env("SERVICE", "default"),
                   help="service name: the key prefix /kvhold/SERVICE/sidecars/ (env KVHOLD_SERVICE, "
                        "default %(default)s)")
    if ttl:
        p.add_argument("--registry-ttl", type=int, default=5,
                       help="etcd lease seconds: a dead sidecar leaves the registry this long after "
                            "its last refresh (default 5)")


def add_tcp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--client-tcp", metavar="HOST:PORT", default=env("CLIENT_TCP"),
                   help="also serve SDK clients over TCP, CurveZMQ-encrypted (port 0: any free "
                        "port; see `kvhold status --json` for the one bound) (env KVHOLD_CLIENT_TCP)")
    p.add_argument("--curve-secret-key", metavar="FILE", type=Path, default=None,
                   help="the sidecar's key pair for --client-tcp: a .key_secret file from "
                        "`kvhold keygen`, mode 0600")
    p.add_argument("--curve-authorized-keys", metavar="DIR", type=Path, default=None,
                   help="serve only clients whose public key is a *.key file in DIR (re-read when "
                        "files are added or removed); without it, any client that knows the "
                        "server's public key is served")
    p.add_argument("--insecure-tcp", action="store_true",
                   help="allow --client-tcp without CURVE: plaintext and unauthenticated; only for "
                        "a network you fully trust")


class _Refused(argparse.Action):
    """A flag of vLLM's that kvhold has no counterpart for: refused, saying why and what kvhold
    has instead. `accept`: the values that mean what kvhold does anyway (accepted, changing nothing)."""

    def __init__(self, option_strings, dest, why: str, accept=(), nargs=None, **kwargs):
        super().__init__(option_strings, argparse.SUPPRESS, nargs=nargs, default=argparse.SUPPRESS,
                         help=f"vLLM's; {why}" + (f" (accepted: {', '.join(accept)})" if accept else ""))
        self.why, self.accept = why, tuple(accept)

    def __call__(self, parser, namespace, values, option_string=None):
        if values in self.accept:
            return
        raise argparse.ArgumentError(self, self.why)


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM flags kvhold refuses, each with the reason and kvhold's nearest flag (its aliases
    of vLLM's names are on the flags themselves: --max-model-len, --max-num-seqs, ...)."""
    p.add_argument("--trust-remote-code", action=_Refused, nargs=0,
                   why="kvhold never runs a checkpoint's own code: it runs the architectures it "
                       "implements (Llama, Mistral, Qwen2, Qwen3, Phi-3) from their weights")
    p.add_argument("--kv-cache-dtype", action=_Refused, accept=("auto",),
                   why="kvhold keeps the KV cache in the compute dtype (--dtype); an FP8 KV cache is "
                       "not built")
    p.add_argument("--generation-config", action=_Refused, accept=("vllm",),
                   why="kvhold does not take default sampling parameters from the checkpoint's "
                       "generation_config.json: a request's unset fields get OpenAI's defaults, as "
                       "vLLM's --generation-config vllm does")
    p.add_argument("--tokenizer", action=_Refused,
                   why="kvhold reads the tokenizer from the checkpoint directory (--model)")
    p.add_argument("--quantization", "-q", action=_Refused,
                   why="kvhold runs the checkpoint's weights in --dtype; quantized weights are not built")
    p.add_argument("--swap-space", action=_Refused,
                   why="kvhold preempts by recompute, never by swapping to host memory; size the KV "
                       "pool with --kv-pages, --kv-memory or --gpu-memory-utilization")


# setting path (kvhold.sidecar.config) -> the argparse dest of the flag that sets it; the
# flag is "--" + dest with dashes, but for the negated ones (FLAGS). One table builds the
# config and names the flags in its errors.
SETTINGS = {
    "pool.model": "model", "pool.backend": "backend", "pool.device": "device",
    "pool.kv_pages": "kv_pages", "pool.kv_memory_bytes": "kv_memory", "pool.page_tokens": "page_tokens",
    "pool.tensor_parallel_size": "tensor_parallel_size",
    "pool.gpu_memory_utilization": "gpu_memory_utilization",
    "pool.max_seq_len": "max_seq_len", "pool.max_requests": "max_requests",
    "pool.max_logprobs": "max_logprobs", "pool.max_grammar_bytes": "max_grammar_bytes",
    "pool.max_prompt_bytes": "max_prompt_bytes",
    "pool.compute_dtype": "compute_dtype",
    "executors.workload": "workload", "executors.standbys": "standbys", "executors.lease_ms": "lease_ms",
    "executors.startup_lease_ms": "startup_lease_ms", "executors.kill_fenced": "kill_fenced",
    "executors.spawn_executors": "spawn_executors", "executors.max_batch": "max_batch",
    "executors.max_batch_tokens": "max_batch_tokens", "executors.prefill_chunk": "prefill_chunk",
    "executors.cpu_threads": "cpu_threads", "executors.token_file": "token_file",
    "executors.restart_backoff_ms": "restart_backoff_ms", "executors.zygote": "zygote",
    "executors.zygote_spare": "zygote_spare",
    "executors.takeover": "takeover", "executors.kv_mode": "kv_mode",
    "executors.sidecar_wait_ms": "sidecar_wait_ms", "executors.exact_prefill": "exact_prefill",
    "executors.prefix_caching": "prefix_caching", "executors.cuda_graph": "cuda_graph",
    "executors.vllm_any_version": "vllm_any_version",
    "pool.seed": "seed",
    "health.source": "health", "health.interval_s": "health_interval",
    "client_tcp.address": "client_tcp", "client_tcp.curve_secret_key": "curve_secret_key",
    "client_tcp.curve_authorized_keys": "curve_authorized_keys", "client_tcp.insecure": "insecure_tcp",
    "registry.url": "registry", "registry.service": "service", "registry.ttl_s": "registry_ttl",
    "journal.dir": "journal_dir", "journal.unclaimed_cancel_s": "unclaimed_cancel_s",
    "logs.stats_interval_s": "stats_interval",
}
_NEGATED = {"kill_fenced": "--no-kill-fenced", "spawn_executors": "--no-spawn",   # store_false flags
            "prefix_caching": "--enable-prefix-caching", "cuda_graph": "--enforce-eager"}
FLAGS = {path: _NEGATED.get(dest, "--" + dest.replace("_", "-")) for path, dest in SETTINGS.items()}


def flag_message(exc: ValueError) -> str:
    """A config error as the command line should say it: settings named by their flags."""
    from kvhold.sidecar.config import SettingError

    if isinstance(exc, SettingError):
        return exc.renamed(lambda path: FLAGS.get(path, path), FLAGS)     # every setting it mentions
    return str(exc)


def sidecar_config_from_args(args):
    """The SidecarConfig the flags describe; a bad value is a ValueError naming its flag."""
    from kvhold.sidecar.config import SettingError

    try:
        return _sections_from_args(args)
    except SettingError as exc:
        raise ValueError(flag_message(exc)) from None


def _sections_from_args(args):
    from kvhold.sidecar.config import (ClientTcpConfig, ExecutorsConfig, HealthConfig, JournalConfig,
                                       LogsConfig, PoolConfig, RegistryConfig, SidecarConfig)

    sections = {"pool": PoolConfig, "executors": ExecutorsConfig, "health": HealthConfig,
                "client_tcp": ClientTcpConfig, "registry": RegistryConfig, "journal": JournalConfig,
                "logs": LogsConfig}
    values: dict[str, dict] = {name: {} for name in sections}
    for path, dest in SETTINGS.items():
        section, field = path.split(".")
        values[section][field] = getattr(args, dest)
    executors = values["executors"]
    executors["workload"] = executors["workload"] or ("engine" if args.model else "idle")
    executors["restart_backoff_ms"] = parse_pair(executors["restart_backoff_ms"], "--restart-backoff-ms")
    return SidecarConfig(instance=args.instance, runtime_root=args.runtime_root,
                         **{name: cls(**values[name]) for name, cls in sections.items()})
