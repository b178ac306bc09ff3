"""`kvhold failovers`: after a real SIGKILL of the active executor mid-stream, the picture marks
the failover with the sidecar's own detection -> first resumed token, and the clients' largest
inter-token gap (the frontend's per-second series) holds the stall they crossed."""
import os
import signal
import threading

from kvhold.cli.main import main
from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, submit, wait_until

LONG = [dict(prompt_ids=list(range(40, 60)), max_tokens=300, temperature=0.0, ignore_eos=True),
        dict(prompt_ids=list(range(80, 95)), max_tokens=300, temperature=0.7, seed=3, ignore_eos=True)]


def test_the_picture_of_a_real_failover(tiny_model, start_sidecar, tmp_path, capsys):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS])
    pid = sc.wait_steady()["pid"]
    with sc.new_client(timeout=60) as client:
        streams = submit(client, LONG)
        got = [0]
        first = threading.Event()

        def on_event(stream, event):
            got[0] += 1
            if got[0] == 10:
                os.kill(pid, signal.SIGKILL)
                first.set()
        results = wait_all(streams, on_event)
    assert first.is_set() and all(r.finish_reason == "length" for r in results)
    rec = wait_until(lambda: next((r for r in sc.status()["recoveries"] if r.get("first_token_ns")), None), 30,
                     what="the recovery record")
    out = tmp_path / "failovers.html"
    argv = ["failovers", "--instance", sc.instance, "--runtime-root", str(sc.runtime_root), "--out", str(out)]
    assert main(argv) == 0
    recs = [r for r in sc.status()["recoveries"] if r.get("detect_ns")]     # (a hang on a slow machine adds one)
    assert f"{len(recs)} failover(s)" in capsys.readouterr().out
    page = out.read_text()
    assert "<svg" in page
    for r in recs:
        if r.get("first_token_ns"):
            assert f"failover: {(r['first_token_ns'] - r['detect_ns']) / 1e6:.1f} ms" in page
    series = sc.status()["token_gaps"]["series"]
    # no stream's next token can go out before the takeover has resumed the requests
    assert max(gap for _, gap, _, _ in series) >= (rec["resumed_ns"] - rec["detect_ns"]) / 1e6
    assert sum(tokens for _, _, tokens, _ in series) >= 600 - 10         # every token streamed is counted


def test_the_picture_before_anything_happened():
    from kvhold.cli.failovers import render_svg

    assert "no streamed tokens and no failover" in render_svg({"recoveries": []})
