"""The `kvhold` command: one entry point for every process and tool.

    kvhold demo        build a tiny model, crash an executor mid-generation, show recovery
    kvhold sidecar     run a sidecar (memory owner + supervisor + client frontend)
    kvhold serve       a sidecar plus an OpenAI-compatible HTTP API (FastAPI + uvicorn)
    kvhold router      the same HTTP API, routed to the sidecars registered in etcd
    kvhold executor    run one executor under a sidecar (normally spawned by it)
    kvhold status      print a running sidecar's status (--json for scripts)
    kvhold top         live view of a running sidecar: executors, page pool, recoveries
    kvhold keygen      write a CurveZMQ key pair for the TCP client transport
    kvhold pool-restart  drain, journal requests to disk, restart the pool (driver upgrade)
    kvhold registry    list the sidecars registered in etcd (`kvhold registry list`)

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
    p.add_argument("--health", default=_env("HEALTH", "auto"),
                   help="GPU health source: auto (NVML on a CUDA device, off on CPU), off, nvml, "
                        "nvml:N, or replay:FILE (a recorded signal sequence, for drills and tests). "
                        "Xid/ECC/row-remap/PCIe/GPU-lost signals restart the executor, close "
                        "admissions for a pool restart, or drain (env KVHOLD_HEALTH)")
    p.add_argument("--health-interval", type=float, default=1.0,
                   help="seconds between health polls (default 1.0)")
    p.add_argument("--zygote", action="store_true", default=_env("ZYGOTE") == "1",
                   help="keep a zygote (torch imported, no CUDA context) and fork executors from it "
                        "instead of starting them cold (env KVHOLD_ZYGOTE=1)")
    p.add_argument("--takeover", default="fast", choices=("fast", "wait-exit"),
                   help="fast: promote a standby as soon as the active dies, continuing in fresh "
                        "copies of the pages it could still write; wait-exit: promote only once the "
                        "dead process has fully exited (its GPU context torn down; ~100 ms on an H200)")
    p.add_argument("--kv-mode", default="native", choices=("native", "foreign"),
                   help="native: the engine computes in kvhold's KV pages; foreign: it keeps a "
                        "private KV pool (as TensorRT-LLM does) protected by the KV mirror")
    p.add_argument("--no-kill-fenced", dest="kill_fenced", action="store_false",
                   help="fence hung executors without SIGKILLing them")
    p.add_argument("--no-spawn", dest="spawn_executors", action="store_false",
                   help="do not spawn executors; wait for external ones to attach")
    p.add_argument("--token-file", type=Path, default=None,
                   help="executor token file (0600); default: a fresh token in the runtime dir")
    p.add_argument("--journal-dir", type=Path, default=_env("JOURNAL_DIR"),
                   help="durable request journal for pool restarts, on local disk (env "
                        "KVHOLD_JOURNAL_DIR; default STATE/journal/INSTANCE, STATE being "
                        "$KVHOLD_STATE_DIR, systemd's $STATE_DIRECTORY, /var/lib/kvhold as root, "
                        "else $XDG_STATE_HOME/kvhold)")
    add_tcp_args(p)
    add_registry_args(p)


def add_registry_args(p: argparse.ArgumentParser, ttl: bool = True) -> None:
    p.add_argument("--registry", metavar="etcd://HOST:PORT[,HOST:PORT]", default=_env("REGISTRY"),
                   help="register this sidecar in etcd (node, GPU, model, generation, health, load) "
                        "under a lease, so routers find it and move requests off it when it dies "
                        "(env KVHOLD_REGISTRY)" if ttl else
                        "the etcd cluster the sidecars register in (env KVHOLD_REGISTRY)")
    p.add_argument("--service", default=_env("SERVICE", "default"),
                   help="service name: the key prefix /kvhold/SERVICE/sidecars/ (env KVHOLD_SERVICE, "
                        "default %(default)s)")
    if ttl:
        p.add_argument("--registry-ttl", type=int, default=5,
                       help="etcd lease seconds: a dead sidecar leaves the registry this long after "
                            "its last refresh (default 5)")


def add_tcp_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--client-tcp", metavar="HOST:PORT", default=_env("CLIENT_TCP"),
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
        restart_backoff_ms=parse_pair(args.restart_backoff_ms, "--restart-backoff-ms"),
        zygote=args.zygote, takeover=args.takeover, health=args.health, kv_mode=args.kv_mode,
        health_interval_s=args.health_interval,
        client_tcp=args.client_tcp, curve_secret_key=args.curve_secret_key,
        curve_authorized_keys=args.curve_authorized_keys, insecure_tcp=args.insecure_tcp,
        registry=args.registry, service=args.service, registry_ttl_s=args.registry_ttl,
        journal_dir=args.journal_dir)


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


def cmd_top(args) -> int:
    from kvhold.top import run_top

    return run_top(args.instance, args.runtime_root, interval=args.interval, once=args.once,
                   timeout=args.timeout)


def cmd_registry(args) -> int:
    from ipc.registry_client import RegistryUnavailable, list_entries

    if not args.registry:
        print("kvhold registry: give --registry etcd://HOST:PORT (or KVHOLD_REGISTRY)", file=sys.stderr)
        return 2
    try:
        entries, bad = list_entries(args.registry, args.service)
    except (ValueError, RegistryUnavailable) as exc:
        print(f"kvhold registry: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{"key": e.key, **json.loads(e.to_json())} for e in entries], indent=2))
    else:
        print("\n".join(e.describe() for e in entries) or "(no sidecars registered)")
    for line in bad:
        print(f"ignored: {line}", file=sys.stderr)
    return 0


def cmd_keygen(args) -> int:
    from ipc.curve import load_public_key, write_keypair

    try:
        public, secret = write_keypair(args.out, args.name)
    except (ValueError, OSError) as exc:
        print(f"kvhold keygen: {exc}", file=sys.stderr)
        return 1
    print(f"public key  {public}  (share it: clients need the server's; a client's goes into "
          f"the sidecar's --curve-authorized-keys directory)")
    print(f"secret key  {secret}  (mode 0600; keep it where it is)")
    print(f"z85 public  {load_public_key(public).decode()}")
    return 0


def cmd_demo(args) -> int:
    from kvhold.demo import run_demo

    setup_logging(args.log_level, role="demo")
    return run_demo(args)


def cmd_serve(args) -> int:
    """Start a sidecar (active + standby executors) and serve the OpenAI-compatible HTTP API."""
    from kvhold.serve import run_serve, serve_config_from_args

    setup_logging(args.log_level, role="serve")
    try:
        config = serve_config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"kvhold serve: {exc}", file=sys.stderr)
        return 2
    try:
        return run_serve(config)
    except (RuntimeError, TimeoutError) as exc:
        print(f"kvhold serve: {exc}", file=sys.stderr)
        return 1


def cmd_router(args) -> int:
    """Serve the OpenAI-compatible HTTP API by routing to the sidecars registered in etcd."""
    from kvhold.router_http import router_config_from_args, run_router

    setup_logging(args.log_level, role="router")
    try:
        config = router_config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"kvhold router: {exc}", file=sys.stderr)
        return 2
    return run_router(config)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_sidecar_args(p)  # --model also takes "demo": the tiny demo checkpoint, built once
    add_http_args(p)
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds to wait for the sidecar to serve at start-up (default 300)")


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_registry_args(p, ttl=False)
    add_http_args(p)
    p.add_argument("--model", type=Path, default=_env("MODEL"),
                   help="a local copy of the served checkpoint, for its tokenizer and chat template "
                        "(without it /v1/chat/completions is unavailable)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="the sidecars' context length, checked here before routing (default: "
                        "min(model context, 4096))")
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))


def add_http_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="HTTP bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=int(_env("PORT", "8000")), help="HTTP port (default %(default)s)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=_env("API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes (env KVHOLD_API_KEY); "
                          "/health and /metrics stay open")
    key.add_argument("--api-key-file", type=Path, default=None, help="read the API key from this file")
    p.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the checkpoint directory's name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight streams finish (default 30)")


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

    p = sub.add_parser("serve", help="run a sidecar and an OpenAI-compatible HTTP API",
                       description=cmd_serve.__doc__)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router", help="an OpenAI-compatible HTTP API over the sidecars in etcd",
                       description=cmd_router.__doc__)
    add_router_args(p)
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("executor", help="run one executor (normally spawned by the sidecar)")
    add_instance_args(p)
    p.add_argument("--token-file", type=Path, default=None)
    p.set_defaults(func=cmd_executor)

    p = sub.add_parser("status", help="show a running sidecar's executors, pages and recoveries")
    add_instance_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("top", help="live view of a running sidecar (executors, page pool, recoveries)")
    add_instance_args(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    p.set_defaults(func=cmd_top)

    p = sub.add_parser("registry", help="list the sidecars registered in etcd")
    p.add_argument("action", choices=("list",), help="list: one line per registered sidecar")
    add_registry_args(p, ttl=False)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_registry)

    from kvhold.pool_restart import add_pool_restart_parser
    add_pool_restart_parser(sub)

    p = sub.add_parser("keygen", help="write a CurveZMQ key pair (NAME.key, NAME.key_secret)")
    p.add_argument("--out", type=Path, required=True, help="directory for the key files (made 0700)")
    p.add_argument("--name", default="kvhold", help="file name stem (default %(default)s)")
    p.set_defaults(func=cmd_keygen)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
