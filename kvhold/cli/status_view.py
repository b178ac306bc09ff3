"""Human-readable rendering of a sidecar's status (kvhold status)."""
from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table


def fetch_status(args, command: str) -> dict | None:
    """The status of the sidecar `args` name (--instance, --runtime-root, --timeout); None, having
    said why on stderr, when it does not answer."""
    from kvhold.client.client import Client
    from kvhold.protocol.errors import KvholdError

    try:
        with Client.for_instance(args.instance, args.runtime_root, timeout=args.timeout) as client:
            return client.status()
    except KvholdError as exc:
        print(f"kvhold {command}: {exc}", file=sys.stderr)
        return None


def print_status(status: dict, console: Console | None = None) -> None:
    console = console or Console()
    w = status.get("weights", {})
    console.print(f"[bold]kvhold[/] instance [cyan]{status['instance']}[/] pid {status['pid']} "
                  f"generation {status['generation']} up {status['uptime_s']:.0f}s; "
                  f"weights {w.get('state')}")
    table = Table("lease", "pid", "role", "epoch", "heartbeat age", "steps")
    for ex in status.get("executors", []):
        table.add_row(str(ex["slot"]), str(ex["pid"]), ex["role"], str(ex["epoch"]),
                      f"{ex['heartbeat_age_ms']:.0f} ms", str(ex["steps"]))
    console.print(table)
    frontend = status.get("frontend")
    if frontend:     # the split: a memory owner (the pid above) and a frontend process
        owner = status.get("memory_owner") or {}
        console.print(f"frontend: pid {frontend['pid']}, its own process, up {frontend['uptime_s']:.0f}s, "
                      f"{(owner.get('frontend') or {}).get('sessions', '?')} frontend session(s) seen by the sidecar"
                      + ("" if frontend.get("owner_answered") else "; [bold red]the sidecar does not answer[/]"))
    spares = status.get("spares")
    if spares is not None:      # sidecars waiting to take over (kvhold sidecar --spare)
        console.print("spare sidecar: " + (", ".join(f"pid {pid} waiting" for pid in spares) if spares
                                           else "none (a sidecar crash waits for a new process's start)"))
    if status.get("spare"):
        console.print(f"took over as a spare from sidecar pid {status['spare']['previous_pid']}")
    protection = status.get("protection") or {}
    if protection.get("ok") is False:
        console.print(f"[bold red]unprotected[/]: {protection.get('reason')}")
    pages = status.get("pages", {})
    console.print("pages: " + ", ".join(f"{k} {v}" for k, v in pages.items()))
    req = status.get("requests", {})
    console.print(f"requests: {req.get('in_flight', 0)} in flight, "
                  f"{req.get('admitted_total', 0)} admitted, finished {req.get('finished', {})}")
    cache = status.get("prefix_cache")
    if cache:
        rate = cache.get("hit_rate")
        console.print(f"prefix cache: hit rate {'-' if rate is None else f'{100 * rate:.1f}%'} "
                      f"({cache.get('hits', 0)} of {cache.get('queries', 0)} prompt tokens of finished requests)")
    elif "prefix_cache" in status:
        console.print("prefix cache: off")
    for rec in status.get("recoveries", [])[-5:]:
        console.print("recovery: " + ", ".join(f"{k}={v}" for k, v in rec.items() if not k.endswith("_ns")))
