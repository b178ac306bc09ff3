"""The `kvhold` command: one entry point for every process and tool.

    kvhold demo        build a tiny model, crash an executor mid-generation, show recovery
    kvhold sidecar     run a sidecar (memory owner + supervisor + client frontend; with
                       --external-frontend the memory owner and supervisor only)
    kvhold frontend    the client-facing frontend of a sidecar --external-frontend, own process
    kvhold serve       a sidecar plus an OpenAI-compatible HTTP API (FastAPI + uvicorn)
    kvhold router      the same HTTP API, routed to the sidecars registered in etcd
    kvhold executor    run one executor under a sidecar (normally spawned by it)
    kvhold status      print a running sidecar's status (--json for scripts)
    kvhold top         live view of a running sidecar: executors, page pool, recoveries
    kvhold keygen      write a CurveZMQ key pair for the TCP client transport
    kvhold pool-restart  drain, journal requests to disk, restart the pool (driver upgrade)
    kvhold admissions  whether new requests are admitted; --reopen after a health action
    kvhold registry    list the sidecars registered in etcd (`kvhold registry list`)

Each part defines its own flags (`kvhold.sidecar.flags`, `kvhold.serving.flags`,
`kvhold.cli.pool_restart`, `kvhold.cli.admissions`); this module only assembles the subcommands.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvhold import __version__
from kvhold.protocol.logs import setup_logging
from kvhold.serving.flags import add_router_args, add_serve_args
from kvhold.sidecar.flags import (add_instance_args, add_log_level_arg, add_registry_args, add_sidecar_args,
                                 sidecar_config_from_args)


def cmd_sidecar(args) -> int:
    from kvhold.protocol.memory import ShmCapacityError
    from kvhold.sidecar.daemon import run_sidecar
    from kvhold.sidecar.instance_lock import InstanceBusy

    setup_logging(args.log_level, role="sidecar")
    config = None
    try:
        config = sidecar_config_from_args(args)
        if args.external_frontend:
            return run_sidecar(config, spare=args.spare)
        from kvhold.frontend.inline import InlineSidecar

        return run_sidecar(config, spare=args.spare, sidecar_class=InlineSidecar)
    except (ValueError, InstanceBusy, PermissionError, ShmCapacityError) as exc:
        print(f"kvhold sidecar: {exc}", file=sys.stderr)
        _exit_reason(config, str(exc))
        return 2
    except Exception as exc:
        _exit_reason(config, f"{type(exc).__name__}: {exc}")
        raise


def _exit_reason(config, reason: str) -> None:
    """Say why in the runtime dir too, where `kvhold serve` reads it when the sidecar exits."""
    if config is not None:
        try:
            config.paths.write_exit_reason(reason)
        except OSError:
            pass


def cmd_frontend(args) -> int:
    """Serve the clients of a memory owner started with `kvhold sidecar --external-frontend`
    (the same instance and flags): client sockets, admission, tokenizer, streams, durable
    journal. It can be killed and started again at any time; the executors never notice and
    clients resume their streams."""
    from kvhold.frontend.process import run_frontend

    setup_logging(args.log_level, role="frontend")
    try:
        config = sidecar_config_from_args(args)
        return run_frontend(config)
    except (ValueError, RuntimeError, PermissionError) as exc:
        print(f"kvhold frontend: {exc}", file=sys.stderr)
        return 2


def cmd_executor(args) -> int:
    from kvhold.executor.runtime import main

    forwarded = ["--instance", args.instance, "--log-level", args.log_level]
    if args.runtime_root:
        forwarded += ["--runtime-root", str(args.runtime_root)]
    if args.token_file:
        forwarded += ["--token-file", str(args.token_file)]
    return main(forwarded)


def cmd_status(args) -> int:
    from kvhold.cli.status_view import fetch_status

    status = fetch_status(args, "status")
    if status is None:
        return 1
    if args.json:
        json.dump(status, sys.stdout, indent=2, default=str)
        print()
    else:
        from kvhold.cli.status_view import print_status
        print_status(status)
    return 0


def _cmd_failovers(args) -> int:
    from kvhold.cli.failovers import cmd_failovers

    return cmd_failovers(args)


def cmd_top(args) -> int:
    from kvhold.cli.top import run_top

    return run_top(args.instance, args.runtime_root, interval=args.interval, once=args.once,
                   timeout=args.timeout)


def cmd_registry(args) -> int:
    from kvhold.routing.registry_client import RegistryUnavailable, list_entries

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
    from kvhold.protocol.curve import load_public_key, write_keypair

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
    from kvhold.cli.demo import run_demo

    setup_logging(args.log_level, role="demo")
    return run_demo(args)


def cmd_serve(args) -> int:
    """Start a sidecar (active + standby executors) and serve the OpenAI-compatible HTTP API
    (with --sidecar-endpoint: serve it in front of a sidecar that already runs)."""
    from kvhold.serving.serve import run_serve, serve_config_from_args

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


def cmd_serve_http(args) -> int:
    """The HTTP server process of `kvhold serve` (started by it; its configuration in the environment)."""
    from kvhold.serving.serve import CONFIG_ENV, ServeConfig, run_http

    text = os.environ.pop(CONFIG_ENV, None)
    if text is None:
        print(f"kvhold serve-http: started by `kvhold serve` only ({CONFIG_ENV} is not set)", file=sys.stderr)
        return 2
    config = ServeConfig.from_json(text)
    setup_logging(config.log_level, role="serve-http")
    return run_http(config, args.fd)


def cmd_router(args) -> int:
    """Serve the OpenAI-compatible HTTP API by routing to the sidecars registered in etcd."""
    from kvhold.serving.router_http import router_config_from_args, run_router

    setup_logging(args.log_level, role="router")
    try:
        config = router_config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"kvhold router: {exc}", file=sys.stderr)
        return 2
    return run_router(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvhold", description="Keep an LLM server's memory alive when its inference engine dies.")
    parser.add_argument("--version", action="version", version=f"kvhold {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

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
    add_log_level_arg(p, default="WARNING")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sidecar", help="run a sidecar", description=cmd_sidecar.__doc__)
    add_sidecar_args(p)
    p.add_argument("--external-frontend", action="store_true",
                   help="serve no client: own the memory and supervise the executors only, while "
                        "`kvhold frontend` (same instance and flags) serves the clients in its own "
                        "process, which may die and be restarted without touching them")
    p.add_argument("--spare", action="store_true",
                   help="start as a spare: load the code, the checkpoint's description and the "
                        "tokenizer, then wait, holding nothing, until the sidecar now serving this "
                        "instance dies, and take over at once (its memory, executors and requests, "
                        "as a restarted sidecar would), without a new process's start-up. A clean "
                        "stop of that sidecar does not wake it; give it the same flags")
    p.set_defaults(func=cmd_sidecar)

    p = sub.add_parser("frontend", help="the client-facing frontend of a `kvhold sidecar --external-frontend`",
                       description=cmd_frontend.__doc__)
    add_sidecar_args(p)
    p.set_defaults(func=cmd_frontend)

    p = sub.add_parser("serve", help="run a sidecar and an OpenAI-compatible HTTP API",
                       description=cmd_serve.__doc__)
    add_serve_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("serve-http", help="(internal) the HTTP server process that `kvhold serve` starts", description=cmd_serve_http.__doc__)
    p.add_argument("--fd", type=int, required=True, help="the listening socket's descriptor")
    p.set_defaults(func=cmd_serve_http)

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

    p = sub.add_parser("failovers", help="a picture of a running sidecar's failovers (SVG or HTML)",
                       description="Draw the latency the clients saw around each executor failover "
                                   "of a running sidecar: the largest inter-token gap per second "
                                   "(the last ten minutes), each failover marked with its detection "
                                   "-> first resumed token, and each failover's phases. All from "
                                   "the sidecar's own records.")
    add_instance_args(p)
    p.add_argument("--out", default="failovers.svg",
                   help="the file to write: .svg (the picture) or .html (the picture and a table) "
                        "(default %(default)s)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the sidecar")
    p.set_defaults(func=_cmd_failovers)

    p = sub.add_parser("top", help="live view of a running sidecar (executors, page pool, recoveries)",
                       description="A live view of one sidecar that fits the terminal (80x24 at the "
                                   "least): throughput, time to first token, running and waiting "
                                   "requests, executors, the KV page pool (one glyph per state: "
                                   "· free, ▒ partly committed, █ committed, ? quarantined, ~ being "
                                   "written, X bad), recent recoveries and events. q or Ctrl-C quits; "
                                   "a sidecar that stops answering leaves its last frame, marked STALE.")
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

    from kvhold.cli.pool_restart import add_pool_restart_parser
    add_pool_restart_parser(sub)

    from kvhold.cli.admissions import add_admissions_parser
    add_admissions_parser(sub)

    p = sub.add_parser("keygen", help="write a CurveZMQ key pair (NAME.key, NAME.key_secret)")
    p.add_argument("--out", type=Path, required=True, help="directory for the key files: made 0700; an existing one must "
                        "already be 0700 and yours (refused otherwise, never chmod-ed)")
    p.add_argument("--name", default="kvhold", help="file name stem (default %(default)s)")
    p.set_defaults(func=cmd_keygen)
    return parser


def _children_import_this_package() -> None:
    """kvhold's child processes (`python -m kvhold ...`: the sidecar, the frontend, executors,
    the zygote) put the working directory first on their import path: started from a folder
    that holds a directory named `kvhold` (a clone, seen from its parent), they would import
    that instead of this package. Unless this package is the one in the working directory, they
    start with PYTHONSAFEPATH (Python 3.11 and later), which leaves the working directory out."""
    import kvhold

    here = Path(kvhold.__file__).resolve().parent.parent
    if here != Path.cwd().resolve():
        os.environ.setdefault("PYTHONSAFEPATH", "1")


def main(argv=None) -> int:
    _children_import_this_package()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:        # a bare `kvhold`: say what it can do
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
