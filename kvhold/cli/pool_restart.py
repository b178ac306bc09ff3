"""`kvhold pool-restart`: restart a sidecar's pool (driver upgrade) without losing a request.

    kvhold pool-restart [--instance NAME] [--continue | --wait-for-operator] [--timeout S]
    kvhold pool-restart --resume [--instance NAME]

Sends `PoolRestart` on the sidecar's local socket. The sidecar stops admitting, tells
its clients to wait, stops its executors, writes every in-flight request with its
committed tokens to the durable journal, releases all memory and re-executes itself
(same pid, same flags; kvhold.sidecar.pool_restart). The new image builds a pool of the next
generation, reloads the weights, re-admits the journaled requests and resumes their
streams (kvhold.frontend.restore). This command waits for that and prints the figures.

--continue (default): restart at once. --wait-for-operator: the new image waits,
holding no device memory, until you press Enter here (on a terminal) or run
`kvhold pool-restart --resume`; do the driver upgrade in between. A reboot in
between is fine too: the sidecar started at boot finds the journal on disk.
--timeout bounds the wait for the new pool and is the pause SDK clients are told to
wait through (a longer hold makes them give up; their requests still finish and are
kept for pickup). Exit codes: 0 done (or held, when not on a terminal); 1 the sidecar
is not reachable, did not come back in time, or died during the drain and its spare
re-adopted the old pool (nothing lost, the restart not done: run it again); 3 some
requests could not be restored (listed with the reason).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvhold.client.client import Client
from kvhold.protocol.errors import KvholdError
from kvhold.protocol.leases import now_ns
from kvhold.protocol.naming import InstancePaths

POLL_S = 0.1


def add_pool_restart_parser(sub) -> None:
    from kvhold.sidecar.flags import add_instance_args

    p = sub.add_parser("pool-restart", help="drain, journal requests to disk and restart the pool "
                       "(driver upgrade) without losing a request", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_instance_args(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--continue", dest="hold", action="store_false",
                      help="start the new pool as soon as the old one is drained (default)")
    mode.add_argument("--wait-for-operator", dest="hold", action="store_true",
                      help="after the drain, hold (no device memory in use) until Enter or --resume")
    mode.add_argument("--resume", action="store_true",
                      help="release a sidecar held by --wait-for-operator and wait for its new pool")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the new pool to serve; also the pause SDK clients "
                        "are told to wait through (default 300)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=cmd_pool_restart, hold=False)


def cmd_pool_restart(args) -> int:
    paths = InstancePaths.for_instance(args.instance, args.runtime_root)
    try:
        if args.resume:
            return _resume(paths, args)
        with Client(paths.client_endpoint, timeout=5.0) as client:
            reply = client.pool_restart(hold=args.hold, client_grace_s=args.timeout)
    except KvholdError as exc:
        print(f"kvhold pool-restart: {exc}", file=sys.stderr)
        return 1
    _say(args, f"draining generation {reply.generation} of instance {paths.instance!r}: "
               f"{reply.in_flight} requests in flight, journal {reply.journal_dir}")
    if args.hold:
        if not _wait_for_hold(paths, args.timeout):
            print("kvhold pool-restart: the sidecar did not reach the hold in time", file=sys.stderr)
            return 1
        _say(args, "drained: the old pool is gone and the sidecar holds no device memory.\n"
                   "Do the upgrade now; then press Enter here, or run "
                   f"`kvhold pool-restart --resume --instance {paths.instance}`.")
        if not sys.stdin.isatty():
            return 0
        input()
        release_hold(paths)
    return _report(paths, args, reply.generation)


def release_hold(paths: InstancePaths) -> int | bool:
    """Release a held sidecar: the generation it drained (True if unknown), False if none was held."""
    record = paths.release_hold()
    if record is None:
        return False
    return record.get("generation", 0) or True


def _resume(paths: InstancePaths, args) -> int:
    generation = release_hold(paths)
    if generation is False:
        print(f"kvhold pool-restart: no sidecar of instance {paths.instance!r} is on hold",
              file=sys.stderr)
        return 1
    return _report(paths, args, int(generation))


def _wait_for_hold(paths: InstancePaths, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if paths.on_hold and not paths.client_socket.exists():
            return True
        time.sleep(POLL_S)
    return False


def wait_for_new_pool(paths: InstancePaths, old_generation: int, timeout: float) -> dict | None:
    """The new generation's status once its restored requests produce tokens again (or it
    restored none and an executor is active); None on timeout."""
    deadline = time.monotonic() + timeout
    with Client(paths.client_endpoint, timeout=1.0) as client:
        while time.monotonic() < deadline:
            try:
                status = client.status()
            except KvholdError:
                time.sleep(POLL_S)
                continue
            if status["generation"] > old_generation and _serving(status):
                return status
            if _interrupted(status, old_generation):
                return status
            time.sleep(POLL_S)
    return None


def _interrupted(status: dict, old_generation: int) -> dict | None:
    """The drain of `old_generation` was dropped: its sidecar died and a spare re-adopted the pool."""
    gone = (status.get("pool_restart") or {}).get("interrupted")
    return gone if gone and gone.get("generation") == old_generation == status["generation"] else None


def _serving(status: dict) -> bool:
    restore = status.get("pool_restart", {}).get("restore", {})
    if restore.get("requests_restored"):
        return bool(restore.get("first_token_ns"))
    return any(e.get("role") == "active" and e.get("ready") for e in status["executors"])


def figures(status: dict) -> dict:
    """Where the pool restart spent its time (ms from the drain's start), from the sidecar's clocks."""
    pr = status.get("pool_restart", {})
    drain, restore = pr.get("previous_drain") or {}, pr.get("restore", {})
    t0 = drain.get("drain_start_ns")
    started_ns = restore.get("sidecar_started_ns") or now_ns() - int(status["uptime_s"] * 1e9)
    promoted = [e["ns"] for e in status.get("events", []) if e["kind"] == "promote"]
    marks = {"executors_stopped": drain.get("executors_stopped_ns"),
             "journaled": drain.get("journaled_ns"), "new_sidecar_started": started_ns,
             "requests_restored": restore.get("restored_ns"),
             "executor_active": promoted[0] if promoted else None,
             "first_token": restore.get("first_token_ns") or None}
    out = {"generation": status["generation"], "in_flight_at_drain": drain.get("in_flight"),
           "requests_journaled": drain.get("requests_journaled"),
           "requests_restored": restore.get("requests_restored", 0),
           "failed": pr.get("failed", []), "unclaimed": pr.get("unclaimed", [])}
    if t0:
        out["ms_from_drain_start"] = {k: round((v - t0) / 1e6, 1) for k, v in marks.items() if v}
    return out


def _report(paths: InstancePaths, args, old_generation: int) -> int:
    status = wait_for_new_pool(paths, old_generation, args.timeout)
    if status is None:
        print(f"kvhold pool-restart: no new pool generation within {args.timeout:.0f} s; see the "
              "sidecar's log and `kvhold status`", file=sys.stderr)
        return 1
    gone = _interrupted(status, old_generation)
    if gone:
        print(f"kvhold pool-restart: interrupted: the sidecar pid {gone['dead_pid']} died during the drain "
              f"and pid {gone['readopted_by']} re-adopted the pool (generation {old_generation}, unchanged); "
              "no request was lost and the pool serves as before. Run `kvhold pool-restart` again to "
              "restart it", file=sys.stderr)
        return 1
    fig = figures(status)
    if args.json:
        json.dump(fig, sys.stdout, indent=2)
        print()
    else:
        print(f"pool generation {fig['generation']} serving: {fig['requests_restored']} requests "
              f"restored, {len(fig['failed'])} failed")
        for name, ms in fig.get("ms_from_drain_start", {}).items():
            print(f"  +{ms:9.1f} ms  {name.replace('_', ' ')}")
        for f in fig["failed"]:
            print(f"  FAILED request {f['request_id']:#x}: {f['reason']} ({f['path']})")
    return 3 if fig["failed"] else 0


def _say(args, text: str) -> None:
    if not args.json:
        print(text, flush=True)
