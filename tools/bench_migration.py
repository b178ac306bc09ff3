"""Cross-sidecar migration time: SIGKILL a sidecar mid-stream, time its requests' move.

    python -m tools.bench_migration --kills 10            # -> bench/results/migration_cpu.json

Starts a throwaway etcd and two sidecars (tiny demo model, CPU) registered in it, then
repeats: stream `--requests` requests through kvhold.routing.router.RoutedClient, and once a stream
on the victim has `--kill-after` tokens, SIGKILL the victim's whole process group (the
sidecar and its executors), or SIGSTOP it with `--mode stop` (a machine that vanished:
no connection reset, only the lease expiry or silence tells). Per kill it records, from
the signal: detection (the router declares the sidecar lost), resubmission (the other
sidecar accepted the moved request), and the first token from the other sidecar; and
checks every output against an uninterrupted run. The victim is restarted between kills
and the two sidecars alternate as victims.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from kvhold.client.client import wait_all as client_wait_all
from kvhold.routing.registry_client import EtcdGateway, RegistryView
from kvhold.routing.router import RoutedClient, wait_all
from kvhold.testing.etcd_process import EtcdProcess
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.sidecar_process import SidecarProcess

SERVICE = "bench-migration"
FLAGS = ["--kv-pages", "512", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
         "--standbys", "0", "--service", SERVICE]


def requests_for(n: int, max_tokens: int) -> list[dict]:
    return [dict(prompt=f"Request number {i} keeps going", max_tokens=max_tokens,
                 temperature=0.8, seed=100 + i) for i in range(n)]


def submit(client, reqs):
    return [client.generate(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}) for r in reqs]


def one_kill(view, victim: SidecarProcess, key: str, reqs, reference, args) -> dict:
    marks: dict = {}

    def on_event(stream, event):
        now = time.monotonic()
        if "signal" not in marks and stream.sidecars[-1] == key and event.index >= args.kill_after:
            os.killpg(victim.proc.pid, signal.SIGKILL if args.mode == "kill" else signal.SIGSTOP)
            marks["signal"] = now
        elif "signal" in marks and stream.moves and "first_token" not in marks:
            marks["first_token"] = now

    with RoutedClient(view, silence_s=args.silence) as router:
        results = wait_all(submit(router, reqs), on_event)
    if args.mode == "stop":
        os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.stop(signal.SIGKILL)
    moves = [mv for r in results for mv in r.moves]
    if not moves:       # the victim's streams had all finished (buffered) before the signal
        return {}
    t0 = marks["signal"]
    ms = lambda t: round((t - t0) * 1e3, 2)
    return {"moved_requests": len(moves), "tokens_carried": [mv["tokens_carried"] for mv in moves],
            "reasons": sorted({mv["reason"] for mv in moves}),
            "detect_ms": ms(min(mv["lost_at"] for mv in moves)),
            "resubmitted_ms": ms(max(mv["lost_at"] + mv["resubmitted_s"] for mv in moves)),
            "first_token_ms": ms(marks["first_token"]),
            "identical": [r.token_ids for r in results] == reference}


def summary(values: list[float]) -> dict:
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]
    return {"p50": round(statistics.median(values), 2), "p99": round(pick(0.99), 2),
            "max": round(values[-1], 2), "n": len(values)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--kill-after", type=int, default=8, help="tokens a victim's stream has first")
    p.add_argument("--mode", choices=("kill", "stop"), default="kill")
    p.add_argument("--ttl", type=int, default=2, help="registry lease seconds")
    p.add_argument("--silence", type=float, default=5.0, help="router's silence limit, seconds")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out or Path(f"bench/results/migration_cpu{'' if args.mode == 'kill' else '_stop'}.json")
    work = Path(tempfile.mkdtemp(prefix="kvh-mig-"))
    model, _ = ensure_demo_model()
    reqs = requests_for(args.requests, args.max_tokens)
    with EtcdProcess(work / "etcd") as etcd:
        flags = ["--model", str(model), *FLAGS, "--registry", etcd.url, "--registry-ttl", str(args.ttl)]
        sidecars = [SidecarProcess(flags, instance=f"mig{i}", log_path=work / f"mig{i}.log").start()
                    for i in range(2)]
        view = RegistryView(EtcdGateway.from_url(etcd.url), SERVICE).start()
        try:
            with sidecars[0].new_client() as client:
                reference = [r.token_ids for r in client_wait_all(submit(client, reqs))]
            runs = []
            for k in range(args.kills):
                victim = sidecars[k % 2]
                victim.wait_steady(standbys=0)
                idle = lambda es: sum(e.health == "ok" and not e.in_flight for e in es) == 2
                if not view.wait_until(idle, 30):
                    raise RuntimeError(f"both sidecars never listed as ok: {view.entries()}")
                key = next(e.key for e in view.entries() if e.instance == victim.instance)
                run = one_kill(view, victim, key, reqs, reference, args)
                print(f"kill {k + 1}: {run or 'nothing was in flight on the victim: not counted'}",
                      flush=True)
                if run:
                    runs.append(run)
                view.wait_until(lambda es: all(e.key != key for e in es), 3 * args.ttl + 5)
                victim.start()
        finally:
            view.stop()
            for sc in sidecars:
                sc.stop()
    report = {"mode": args.mode, "kills": len(runs), "requests": args.requests,
              "max_tokens": args.max_tokens, "registry_ttl_s": args.ttl, "device": "cpu",
              "all_identical": all(r["identical"] for r in runs),
              "first_token_ms": summary([r["first_token_ms"] for r in runs]),
              "detect_ms": summary([r["detect_ms"] for r in runs]),
              "resubmitted_ms": summary([r["resubmitted_ms"] for r in runs]), "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return 0 if report["all_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
