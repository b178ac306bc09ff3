"""`kvhold demo`: crash an executor mid-generation on CPU and show that nothing is lost.

1. Build (once, cached) a small Llama-architecture checkpoint with a locally trained
   BPE tokenizer.
2. Start a real sidecar with an active and a hot standby executor.
3. Run the requests once without interference: the reference.
4. Run them again, SIGKILL the active executor mid-generation, keep streaming.
5. Print the recovery timeline from the sidecar's own records, and compare every
   output with the reference token by token.
"""
from __future__ import annotations

import os
import signal
import time

from rich.console import Console

from kvhold.client.client import wait_all
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.sidecar_process import SidecarProcess

PROMPTS = [
    ("The sidecar keeps the memory", dict(temperature=0.0)),
    ("Once upon a time a quick brown fox", dict(temperature=0.8, seed=7)),
    ("Write the journal, then commit", dict(temperature=1.0, top_p=0.9, seed=3)),
    ("One two three four", dict(temperature=0.7, top_k=20, seed=11)),
    ("A standby executor is always", dict(temperature=0.0)),
    ("Recover every request, token for token", dict(temperature=0.9, top_p=0.8, top_k=50, seed=5)),
    ("Green river, dark mountain", dict(temperature=0.6, seed=21)),
    ("Never lose a stream", dict(temperature=1.2, seed=99)),
]


def _ms(ns: int) -> str:
    return f"{ns / 1e6:8.1f} ms"


def run_demo(args) -> int:
    console = Console(highlight=False)
    t_start = time.monotonic()
    console.print("[bold]kvhold demo[/]: an executor is SIGKILLed mid-generation; the service is not.\n")
    model, built = ensure_demo_model(args.cache_dir, progress=True)
    console.print(f"model    {model}")
    console.print(f"         {'built now' if built else 'cached'}: Llama architecture, random weights, "
                  "local BPE tokenizer")
    requests = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    flags = ["--model", str(model), "--max-seq-len", "512", "--log-level", args.log_level]
    log_path = model.parent / "demo-sidecar.log"
    log_path.unlink(missing_ok=True)
    with SidecarProcess(flags, instance=f"demo-{os.getpid()}", log_path=log_path) as sc:
        active = sc.wait_steady()
        standby = SidecarProcess.executors(sc.status(), "standby")[0]
        console.print(f"sidecar  pid {sc.proc.pid}: active executor pid {active['pid']}, "
                      f"hot standby pid {standby['pid']} (log: {log_path})\n")
        client = sc.new_client(timeout=30)

        def submit():
            return [client.generate(p, max_tokens=args.max_tokens, **kw) for p, kw in requests]

        t0 = time.monotonic()
        reference = wait_all(submit())
        ref_s = time.monotonic() - t0
        total = sum(len(r.token_ids) for r in reference)
        console.print(f"reference run: {len(reference)} concurrent requests, {total} tokens, "
                      f"{ref_s:.2f} s, no crash")

        kill = {}

        def on_event(stream, event):
            kill.setdefault("streamed", 0)
            kill["streamed"] += 1
            if kill["streamed"] == args.kill_after and "ns" not in kill:
                victim = sc.wait_steady()
                kill.update(pid=victim["pid"], epoch=victim["epoch"], ns=time.monotonic_ns())
                os.kill(victim["pid"], signal.SIGKILL)

        t0 = time.monotonic()
        outputs = wait_all(submit(), on_event)
        crash_s = time.monotonic() - t0
        console.print(f"crash run:     same requests, SIGKILL after {args.kill_after} streamed tokens, "
                      f"done in {crash_s:.2f} s\n")
        sc.wait_steady()
        status = sc.status()
    return _report(console, kill, status, reference, outputs, time.monotonic() - t_start)


def _report(console, kill, status, reference, outputs, elapsed_s) -> int:
    if "ns" not in kill:
        console.print("[red]the kill never happened: raise --max-tokens or lower --kill-after[/]")
        return 1
    t0 = kill["ns"]
    events = status["events"]
    fence = next(e for e in events if e["kind"] == "fence" and e["pid"] == kill["pid"])
    promote = next(e for e in events if e["kind"] == "promote" and e["ns"] >= t0)
    exited = next((e for e in events if e["kind"] == "exit" and e["pid"] == kill["pid"]), None)
    respawn = next((e for e in events if e["kind"] == "ready" and e["ns"] > t0), None)
    rec = next(r for r in status["recoveries"] if r["fenced_epoch"] == kill["epoch"])
    rows = [
        (0, f"SIGKILL active executor pid {kill['pid']} (epoch {kill['epoch']})"),
        (fence["detect_ns"] - t0, "sidecar detects the death (robust futex released by the kernel)"),
        (fence["fenced_ns"] - t0, f"fenced: epoch {kill['epoch']} revoked, its writes now refused"),
        (promote["ns"] - t0, f"hot standby pid {promote['pid']} promoted: weights and KV already mapped"),
        (rec["promoted_ns"] - t0, "standby starts the takeover"),
        (rec["validated_ns"] - t0, f"validated {rec['pages_checked']} KV pages in one pass: "
                                   f"{rec['pages_checked'] - rec['pages_bad']} intact, {rec['pages_bad']} bad"),
        (rec["resumed_ns"] - t0, f"{rec['requests_resumable']} requests resumable, {rec['requests_damaged']} "
                                 f"damaged, {rec['requests_lost']} lost; {rec['pages_copied']} tail pages copied"),
        (rec["first_token_ns"] - t0, "first resumed token committed and streamed"),
    ]
    if exited:
        rows.append((exited["ns"] - t0, f"its exit confirmed (pidfd, code {exited['exit_code']}): "
                                        "quarantined pages freed"))
    if respawn:
        rows.append((respawn["ns"] - t0, f"new hot standby pid {respawn['pid']} ready"))
    console.print("[bold]recovery timeline[/] (from the kill; the sidecar's and executors' own clocks)")
    for ns, text in sorted(rows):
        console.print(f"  +{_ms(ns)}  {text}")
    console.print(f"\n  KV reused: {rec['tokens_kept']} tokens; recomputed: {rec['tokens_recomputed']} tokens; "
                  f"weights reloaded: 0 bytes\n")
    same = 0
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ok = ref.token_ids == out.token_ids and ref.finish_reason == out.finish_reason
        same += ok
        mark = "[green]identical[/]" if ok else "[red]DIFFERENT[/]"
        ids = " ".join(map(str, out.token_ids[:8]))
        console.print(f"  request {i}: {len(out.token_ids):3d} tokens ({out.finish_reason}) {mark}  [{ids} ...]")
    n = len(outputs)
    verdict = "[bold green]" if same == n else "[bold red]"
    console.print("  (random weights: the text itself is meaningless; the token ids are what must match)")
    console.print(f"\n{verdict}{same}/{n} outputs identical to the uninterrupted run[/]")
    console.print(f"kill -> first resumed token {(rec['first_token_ns'] - t0) / 1e6:.1f} ms; "
                  f"demo took {elapsed_s:.1f} s")
    return 0 if same == n else 1
