"""Health events acted on by a real sidecar: signals replayed from a recording drive the
policy (on a GPU the same code reads NVML). An application Xid restarts the active
executor with no request lost; a lost GPU or a double-bit ECC error closes admissions
while requests in flight complete, until the operator reopens them (`kvhold admissions`)."""
import json
import subprocess
import sys
import time

import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.errors import ShuttingDown
from tests.process.helpers import DATA, FLAGS, ids, submit


def _recording(tmp_path, entries) -> str:
    path = tmp_path / "signals.json"
    path.write_text(json.dumps(entries))
    return str(path)


def _health(st):
    return st["health"]


def test_an_application_xid_restarts_the_active_executor_and_loses_nothing(
        tiny_model, reference, start_sidecar, tmp_path):
    replay = _recording(tmp_path, [{"t": 8.0, "kind": "xid", "detail": {"xid": 13}}])
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--health", f"replay:{replay}",
                        "--health-interval", "0.05"])
    first = sc.wait_steady(timeout=60)["pid"]
    with sc.new_client(timeout=60) as client:
        rounds = 0
        while not _health(sc.status())["actions_taken"] or rounds < 2:
            assert ids(wait_all(submit(client))) == reference, f"round {rounds}"
            rounds += 1
            assert rounds < 400, "the replayed Xid never arrived"
    st = sc.status()
    taken = st["health"]["actions_taken"][0]
    assert taken["action"] == "restart_executor" and taken["executor_pid"] == first
    assert "Xid 13" in taken["reason"]
    fence = next(e for e in st["events"] if e["kind"] == "fence" and e["pid"] == first)
    assert fence["reason"] == "health" and fence["detail"].startswith("health: Xid 13")
    assert sc.wait_steady(timeout=60)["pid"] != first
    assert st["admissions"]["open"]


@pytest.mark.parametrize("signal,action", [
    ({"kind": "gpu_lost", "detail": {"gpu": 0, "error": "GPU is lost"}}, "drain"),
    ({"kind": "ecc_dbe", "detail": {"count": 1, "baseline": 0, "new": 1, "gpu": 0}}, "restart_pool"),
])
def test_a_hardware_fault_closes_admissions_and_in_flight_requests_finish(
        tiny_model, start_sidecar, tmp_path, signal, action):
    replay = _recording(tmp_path, [{"t": 10.0, **signal}])  # after start-up, even on a busy machine
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--health", f"replay:{replay}",
                        "--health-interval", "0.05"])
    sc.wait_steady(timeout=60)
    last_token_ns, results = [0], []

    def on_event(stream, event):
        last_token_ns[0] = time.monotonic_ns()

    with sc.new_client(timeout=60) as client:
        # keep long requests in flight until admissions close under them: each pair is admitted
        # before the one before it is awaited, so that the refused admission finds the last
        # admitted pair (admitted before the event) still streaming
        pending = []
        while True:
            try:
                streams = [client.generate(f"Keep going {i}", max_tokens=400, temperature=0.0,
                                           ignore_eos=True) for i in range(2)]
            except ShuttingDown as exc:
                assert "not admitting" in str(exc)
                break
            results += wait_all(pending, on_event)
            pending = streams
            assert len(results) < 400, "the replayed signal never arrived"
        results += wait_all(pending, on_event)
        st = sc.status()
    assert st["health"]["action"] == action and not st["admissions"]["open"]
    event_ns = st["health"]["events"][0]["ns"]
    assert last_token_ns[0] > event_ns, "no request was in flight when admissions closed"
    assert all(r.finish_reason == "length" and len(r.token_ids) == 400 for r in results)


def _admissions(sc, *flags):
    return subprocess.run([sys.executable, "-m", "kvhold", "admissions", "--instance", sc.instance,
                           "--runtime-root", str(sc.runtime_root), "--json", *flags],
                          capture_output=True, text=True, timeout=30)


def test_the_operator_reopens_admissions_a_drain_closed(tiny_model, reference, start_sidecar):
    replay = DATA / "health" / "gpu_lost.json"
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--health", f"replay:{replay}",
                        "--health-interval", "0.05"])
    sc.wait_steady(timeout=60)
    sc.wait_for(lambda st: not st["admissions"]["open"], timeout=30)
    with sc.new_client(timeout=60) as client:
        with pytest.raises(ShuttingDown, match="not admitting"):
            client.generate("refused", max_tokens=4)
        closed = _admissions(sc)
        assert closed.returncode == 3, closed.stderr
        assert "node drained" in json.loads(closed.stdout)["closed_by"]["health"]
        reopened = _admissions(sc, "--reopen")
        assert reopened.returncode == 0, reopened.stderr
        assert json.loads(reopened.stdout) == {"open": True, "closed_by": {}}
        assert ids(wait_all(submit(client))) == reference
    st = sc.status()
    assert st["admissions"]["open"] and st["health"]["action"] == "none"
    assert st["health"]["actions_taken"][-1]["action"] == "reopen_admissions"
