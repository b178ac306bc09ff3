"""The sidecar frontend's per-step streaming cost: `on_step` for N committed streams, on the CPU.

After each decode step an executor sends `StepDone` with the journal slots it committed, and
the sidecar's frontend (kvhold.frontend.frontend) reads each request's progress and new tokens
from the journal, detokenizes them, builds their log-prob fields and sends one message per
stream to its client. This tool builds that state in one process as the frontend's tests do: a
real tables segment in shared memory, a real `Frontend` with the demo model's tokenizer, N
admitted requests taken by a pretend executor, and a host whose `send_client` encodes every
message with the wire codec and sends it on a ZeroMQ ROUTER socket to the requests' clients
(DEALER sockets, drained between steps). Each step commits one token per stream into the
journal as an executor does (`Journal.commit_tokens`), then times `Frontend.on_step`; the
last step finishes every request (`Journal.finish`: its `Done`), timed apart.

The clients decode what they receive, check that each stream got exactly the tokens committed,
in order, once, and its `Done`, and digest every decoded message: `received_sha256` is the
same for two trees whose clients receive the same thing (same --seed and sizes).

    python -m tools.bench_stream_pump --streams 64 --steps 400
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import hashlib
import io
import json
import os
import platform
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import zmq

from kvhold.protocol import messages as m
from kvhold.protocol import wire
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import FinishReason, KvGeometry, TableGeometry
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.tables import Tables
from kvhold.frontend.client_side import ClientSide
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.frontend.frontend import Frontend
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.testing.make_model import ensure_demo_model

PROMPT_LEN = 64
EPOCH = 1


class BenchSidecar(ClientSide):
    """The sidecar around the frontend, its client side the real one (kvhold.frontend.client_side:
    the ipc ROUTER, the peers' ownership check before each send, the wire codec); no executor,
    and its loop is the tool's."""

    def __init__(self, ctx: zmq.Context, tables: Tables, directory: Path, stack: contextlib.ExitStack):
        self.zctx, self.tables = ctx, tables
        self.config = types.SimpleNamespace(client_tcp=types.SimpleNamespace(address=None),
                                            pool=types.SimpleNamespace(max_prompt_bytes=1 << 20))
        self.paths = types.SimpleNamespace(client_socket=directory / "client.sock",
                                           client_endpoint=f"ipc://{directory / 'client.sock'}")
        self.loop = types.SimpleNamespace(register=lambda sock: None)
        self.posted: list = []
        self.frontend = None
        self._open_client_sockets(stack)

    def turn(self) -> None:
        """One loop turn: client messages, posted callbacks, admissions on disk."""
        self._on_client_events({self.client: zmq.POLLIN})
        while self.posted:
            self.posted.pop(0)()
        self.frontend._admit_ready(budget_ns=None)

    def wake_executor(self) -> None:
        pass

    def post(self, callback) -> None:
        self.posted.append(callback)

    def status(self) -> dict:
        return {}


class Client:
    """One client's DEALER: what it received, as decoded messages, checked and digested."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes):
        self.identity = identity
        self.key = b""                  # as the sidecar knows it (kvhold.frontend.client_peers)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.tokens: dict[int, list[int]] = {}
        self.done: dict[int, m.Done] = {}
        self.num_messages = 0
        self.digest = hashlib.sha256()   # of every message received, in order

    def drain(self) -> None:
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = wire.decode(frame)
            self.num_messages += 1
            # what a client receives, less the Done's measured times (queue_s, prefill_s)
            same = dataclasses.replace(msg, queue_s=None, prefill_s=None) if isinstance(msg, m.Done) else msg
            self.digest.update(wire.encode(same))
            if isinstance(msg, m.Accepted):
                continue
            for event in per_request_events(msg):
                if isinstance(event, m.Tokens):
                    got = self.tokens.setdefault(event.request_id, [])
                    assert event.start == len(got), (event.request_id, event.start, len(got))
                    got.extend(event.ids)
                elif isinstance(event, m.Done):
                    assert event.request_id not in self.done
                    self.done[event.request_id] = event


def per_request_events(msg) -> list:
    """The per-request events a client SDK makes of one message."""
    return [msg]


def stats_ms(samples_ns: list[int]) -> dict:
    a = np.asarray(samples_ns, dtype=np.float64) / 1e6
    return {"n": len(a), "p50": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "min": float(a.min()),
            "max": float(a.max())}


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args) -> dict:
    model, _ = ensure_demo_model()
    spec = ModelSpec.from_dir(model)
    n, steps = args.streams, args.steps
    geometry = TableGeometry(kv=KvGeometry(1, 1, 8, "float32", 16), num_pages=64,
                             num_slots=max(n, 1), max_seq_len=PROMPT_LEN + steps + 8, num_leases=2,
                             max_logprobs=args.logprobs)
    rng = np.random.default_rng(args.seed)
    ctx = zmq.Context()
    work = Path(tempfile.mkdtemp(prefix="kvhold-bench-pump-"))
    tables = Tables.create(f"/kvhold-bench-pump-{os.getpid()}", geometry, generation=1)
    stack = contextlib.ExitStack()
    try:
        host = BenchSidecar(ctx, tables, work, stack)
        fe = host.frontend = Frontend(tables, spec, model, runs_model=True,
                                      durable=DurableJournal(work / "journal"), fingerprint="f" * 64,
                                      timeline=RecoveryTimeline(), host=host)
        clients = [Client(ctx, host.paths.client_endpoint, b"c%02d" % i + bytes(13))
                   for i in range(args.clients)]
        stack.callback(lambda: [c.sock.close(0) for c in clients])
        params = {"max_tokens": steps, "temperature": 0.0}
        if args.logprobs:
            params["logprobs"] = args.logprobs
        deadline = time.monotonic() + 60
        for i in range(n):      # admitted as a client's Generate is, one by one: the same ids each run
            prompt = rng.integers(3, spec.vocab_size, PROMPT_LEN).tolist()
            clients[i % len(clients)].sock.send(wire.encode(
                m.Generate(tag=i + 1, params=params, prompt_ids=prompt)))
            while len(fe.streams) <= i:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(fe.streams)} of {n} requests admitted")
                time.sleep(0.0002)
                host.turn()
        for c in clients:
            c.drain()
        journal = Journal(tables)
        streams = sorted(fe.streams.values(), key=lambda st: st.slot)
        slots = np.array([st.slot for st in streams], dtype=np.int64)
        for st in streams:                       # the executor takes each request
            journal.take(st.slot, st.request_id, EPOCH)
        committed = {st.request_id: [] for st in streams}
        h = types.SimpleNamespace(epoch=EPOCH)
        step_msg = m.StepDone(slot=0, epoch=EPOCH, slots=slots.tolist())
        times, finish_ns = [], None
        profiler = cProfile.Profile() if args.profile else None
        gc.collect()
        for step in range(steps):
            tokens = rng.integers(3, spec.vocab_size, n).astype(np.int32)
            positions = np.full(n, PROMPT_LEN + step, dtype=np.int64)
            lp = None
            if args.logprobs:
                k = args.logprobs
                lp = (slots, positions, -rng.random(n).astype(np.float32),
                      rng.integers(0, spec.vocab_size, (n, k)).astype(np.int32),
                      -rng.random((n, k)).astype(np.float32), positions + 1)
            journal.commit_tokens(slots, positions, tokens, np.full(n, step + 1, dtype=np.uint32), lp)
            for st, t in zip(streams, tokens.tolist()):
                committed[st.request_id].append(t)
            last = step == steps - 1
            if last:
                for s in slots.tolist():
                    journal.finish(s, FinishReason.LENGTH)
            if profiler is not None:
                profiler.enable()
            t0 = time.perf_counter_ns()
            fe.on_step(h, step_msg)
            elapsed = time.perf_counter_ns() - t0
            if profiler is not None:
                profiler.disable()
            if last:
                finish_ns = elapsed
            elif step >= args.warmup:
                times.append(elapsed)
            for c in clients:
                c.drain()
        time.sleep(0.05)
        for c in clients:
            c.drain()
        # every stream got exactly the tokens committed, in order, each once, and its Done
        got = {rid: ids for c in clients for rid, ids in c.tokens.items()}
        done = {rid: d for c in clients for rid, d in c.done.items()}
        assert got == committed, "a stream's tokens differ from those committed"
        assert set(done) == set(committed) and all(
            d.completion_tokens == steps and d.finish_reason == "length" for d in done.values())
        assert not fe.streams and host.peers.num_refused_sends == 0
        digest = hashlib.sha256(b"".join(c.identity + c.digest.digest() for c in clients))
    finally:
        stack.close()
        ctx.term()
        tables.close()
        tables.unlink()
        shutil.rmtree(work, ignore_errors=True)
    step_ms = stats_ms(times)
    results = {
        "command": " ".join([Path(sys.executable).name, "-m", "tools.bench_stream_pump", *sys.argv[1:]]),
        "git": git_commit(), "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "kernel": platform.release(), "loadavg": os.getloadavg()},
        "streams": n, "clients": args.clients, "steps_timed": len(times), "logprobs": args.logprobs,
        "prompt_tokens": PROMPT_LEN, "tokenizer": str(model / "tokenizer.json"),
        "on_step_ms": step_ms,
        "per_stream_us": {"p50": step_ms["p50"] * 1e3 / n, "p99": step_ms["p99"] * 1e3 / n},
        "finishing_step_ms": finish_ns / 1e6 if finish_ns is not None else None,
        "messages_received": sum(c.num_messages for c in clients),  # Accepted ones included
        "received_sha256": digest.hexdigest(),
    }
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(args.profile)
        results["profile_top"] = out.getvalue().splitlines()
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams (default 64)")
    parser.add_argument("--steps", type=int, default=400, help="decode steps, one token per stream "
                        "each; the last finishes every stream (default 400)")
    parser.add_argument("--warmup", type=int, default=20, help="first steps not timed (default 20)")
    parser.add_argument("--clients", type=int, default=4, help="client identities the streams "
                        "belong to, round robin (default 4)")
    parser.add_argument("--logprobs", type=int, default=0, help="top log-probs each request asks "
                        "for (default 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile the timed calls (cProfile) and keep its N top functions")
    parser.add_argument("--out", type=Path, default=Path("bench/results/stream_pump_cpu.json"))
    args = parser.parse_args(argv)
    if args.streams < 1 or args.steps <= args.warmup + 1:
        parser.error("need at least 1 stream and more steps than --warmup + 1")
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    s = results["on_step_ms"]
    print(f"on_step, {results['streams']} streams: P50 {s['p50']:.3f} ms, P99 {s['p99']:.3f} ms "
          f"({results['per_stream_us']['p50']:.1f} us per stream at P50); finishing step "
          f"{results['finishing_step_ms']:.3f} ms; {results['messages_received']} messages received, "
          f"sha256 {results['received_sha256'][:16]}")
    for line in results.get("profile_top", [])[:60]:
        print(line)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
