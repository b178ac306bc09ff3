"""The `kvhold` command: one entry point for every process and tool.

    kvhold demo        build a tiny model, crash an executor mid-generation, show recovery
    kvhold sidecar     run a sidecar (memory owner + supervisor + client frontend)
    kvhold executor    run one executor under a sidecar (normally spawned by it)
    kvhold status      print a running sidecar's status (--json for scripts)

Flags and environment variables are parsed here and nowhere else.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from ipc.logs import setup_logging

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


def _env(name: str, default=None):
    return os.environ.get(f"KVHOLD_{name}", default)


def add_instance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instance", default=_env("INSTANCE", "default"),
                   help="instance name; two sidecars on one host need different names "
                        "(env KVHOLD_INSTANCE, default %(default)s)")
    p.add_argument("--runtime-root", type=Path, default=None,
                   help="directory for sockets and the token (env KVHOLD_RUNTIME_DIR, default "
                        "$XDG_RUNTIME_DIR/kvhold or /tmp/kvhold-<uid>)")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))


def add_sidecar_args(p: argparse.ArgumentParser) -> None:
    add_instance_args(p)
    p.add_argument("--model", type=Path, default=_env("MODEL"),
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--device", default=_env("DEVICE", "cpu"), help="executor device: cpu or cuda:N")
    p.add_argument("--backend", default="host", choices=("host", "cuda"),
                   help="memory backend: host (POSIX shm) or cuda (VMM, needs a GPU)")
    p.add_argument("--workload", default=None, choices=("engine", "idle", "churn"),
                   help="what executors run (default: engine with --model, idle without)")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-pages", type=int, default=None, help="KV pool size in pages")
    kv.add_argument("--kv-memory", type=parse_size, default=None, help="KV pool size, e.g. 2GiB")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="longest sequence (prompt + output); default min(model context, 4096)")
    p.add_argument("--max-requests", type=int, default=256, help="journal slots (default 256)")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences in one step")
    p.add_argument("--max-batch-tokens", type=int, default=512,
                   help="most tokens in one step; prefill is chunked to fit (default 512)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per sequence per step; chunks are cut at fixed positions "
                        "(default: --max-batch-tokens minus --max-batch)")
    p.add_argument("--compute-dtype", default=None, choices=("float64", "float32", "bfloat16", "float16"),
                   help="engine arithmetic and KV dtype (default: float64 on CPU, the checkpoint's on CUDA)")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads per executor on CPU")
    p.add_argument("--standbys", type=int, default=1, help="hot standby executors (default 1)")
    p.add_argument("--lease-ms", type=int, default=1000,
                   help="heartbeat lease: an executor silent this long is fenced (default 1000)")
    p.add_argument("--startup-lease-ms", type=int, default=120_000,
                   help="lease while an executor starts and loads weights (default 120000)")
    p.add_argument("--restart-backoff-ms", default="50,5000",
                   help="after 3 executor deaths within a minute, wait LO*2^k ms (at most HI) before "
                        "each re-spawn (default 50,5000; 0,0 disables)")
    p.add_argument("--no-kill-fenced", dest="kill_fenced", action="store_false",
                   help="fence hung executors without SIGKILLing them")
    p.add_argument("--no-spawn", dest="spawn_executors", action="store_false",
                   help="do not spawn executors; wait for external ones to attach")
    p.add_argument("--token-file", type=Path, default=None,
                   help="executor token file (0600); default: a fresh token in the runtime dir")


def sidecar_config_from_args(args):
    from sidecar.config import SidecarConfig

    workload = args.workload or ("engine" if args.model else "idle")
    return SidecarConfig(
        instance=args.instance, runtime_root=args.runtime_root, model=args.model,
        backend=args.backend, device=args.device, workload=workload,
        kv_pages=args.kv_pages, kv_memory_bytes=args.kv_memory, page_tokens=args.page_tokens,
        max_seq_len=args.max_seq_len, max_requests=args.max_requests, max_batch=args.max_batch,
        max_batch_tokens=args.max_batch_tokens, prefill_chunk=args.prefill_chunk,
        compute_dtype=args.compute_dtype,
        cpu_threads=args.cpu_threads, standbys=args.standbys, lease_ms=args.lease_ms,
        startup_lease_ms=args.startup_lease_ms, kill_fenced=args.kill_fenced,
        spawn_executors=args.spawn_executors, token_file=args.token_file,
        restart_backoff_ms=parse_pair(args.restart_backoff_ms, "--restart-backoff-ms"))


def cmd_sidecar(args) -> int:
    from sidecar.daemon import run_sidecar
    from sidecar.instance_lock import InstanceBusy

    setup_logging(args.log_level, role="sidecar")
    try:
        config = sidecar_config_from_args(args)
        return run_sidecar(config)
    except (ValueError, InstanceBusy, PermissionError) as exc:
        print(f"kvhold sidecar: {exc}", file=sys.stderr)
        return 2


def cmd_executor(args) -> int:
    from executor.runtime import main

    forwarded = ["--instance", args.instance, "--log-level", args.log_level]
    if args.runtime_root:
        forwarded += ["--runtime-root", str(args.runtime_root)]
    if args.token_file:
        forwarded += ["--token-file", str(args.token_file)]
    return main(forwarded)


def cmd_status(args) -> int:
    from ipc.client import Client
    from ipc.errors import KvholdError

    try:
        with Client.for_instance(args.instance, args.runtime_root, timeout=args.timeout) as client:
            status = client.status()
    except KvholdError as exc:
        print(f"kvhold status: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(status, sys.stdout, indent=2, default=str)
        print()
    else:
        from kvhold.status_view import print_status
        print_status(status)
    return 0


def cmd_demo(args) -> int:
    from kvhold.demo import run_demo

    setup_logging(args.log_level, role="demo")
    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvhold", description="Keep an LLM server's memory alive when its inference engine dies.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="crash an executor mid-generation on CPU and watch it recover",
                       description="Builds a small Llama-architecture model locally (cached), starts a "
                                   "sidecar with an active and a standby executor, streams several "
                                   "requests, SIGKILLs the active executor mid-generation and prints "
                                   "the recovery timeline and whether every output equals an "
                                   "uninterrupted run.")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where the demo model is kept (default ~/.cache/kvhold)")
    p.add_argument("--requests", type=int, default=6, help="concurrent requests (default 6)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--kill-after", type=int, default=16,
                   help="SIGKILL the executor once this many tokens were streamed in total")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "WARNING"))
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sidecar", help="run a sidecar", description=cmd_sidecar.__doc__)
    add_sidecar_args(p)
    p.set_defaults(func=cmd_sidecar)

    p = sub.add_parser("executor", help="run one executor (normally spawned by the sidecar)")
    add_instance_args(p)
    p.add_argument("--token-file", type=Path, default=None)
    p.set_defaults(func=cmd_executor)

    p = sub.add_parser("status", help="show a running sidecar's executors, pages and recoveries")
    add_instance_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    p.set_defaults(func=cmd_status)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
