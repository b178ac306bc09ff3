"""Re-arming after a failover, with a real sidecar, real executors and a real SIGKILL: the
replacement standby is started only once the promoted executor has published its first step
(so its start does not compete with the first resumed token), and still within the takeover
grace when there is nothing to step. Orderings come from the sidecar's own recorded marks
(its lifecycle events and the recovery record), all on the sidecar's monotonic clock."""
import os
import signal

from kvhold.client.client import wait_all
from kvhold.sidecar.supervisor import TAKEOVER_GRACE_NS
from tests.process.helpers import FLAGS, ids, submit, wait_stopped

SLACK_NS = 50_000_000      # between the grace's start and the promote event's own mark
GRACE_MARGIN_NS = 5_000_000_000   # a loaded machine's lateness past the grace's end


def _event(st, kind, **match):
    return next((e for e in st["events"] if e["kind"] == kind
                 and all(e.get(k) == v for k, v in match.items())), None)


def _failover(sc, killed):
    """The kill's fence, the promotion and the replacement's spawn, once all three happened."""
    def seen(st):
        fence = _event(st, "fence", pid=killed["pid"])
        promote = fence and _event(st, "promote", fenced_epoch=fence["fenced_epoch"])
        spawn = promote and next((e for e in st["events"] if e["kind"] == "spawn"
                                  and e["ns"] > promote["ns"]), None)
        return spawn and (fence, promote, spawn, st)
    return sc.wait_for(seen, timeout=20)


def _record(st, fenced_epoch):
    return next(r for r in st["recoveries"] if r.get("fenced_epoch") == fenced_epoch)


def test_replacement_standby_starts_after_the_first_resumed_step(tiny_model, reference, start_sidecar, tmp_path):
    # mid-stream: the active executor stops itself at its 5th commit (every request has tokens to
    # go), however slowly this test follows, and is SIGKILLed there
    env = {"KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--lease-ms", "30000"], env=env)
    killed = dict(sc.wait_steady())
    with sc.new_client(timeout=60) as client:
        streams = submit(client)
        wait_stopped(killed["pid"], 60)
        os.kill(killed["pid"], signal.SIGKILL)
        os.kill(killed["pid"], signal.SIGCONT)
        assert ids(wait_all(streams)) == reference
    fence, promote, spawn, st = _failover(sc, killed)
    rec = _record(sc.status(), fence["fenced_epoch"])
    assert rec["epoch"] == promote["epoch"] and rec["requests_resumable"] + rec["requests_damaged"] > 0
    assert promote["ns"] < rec["received_ns"] < rec["step_received_ns"]   # takeover reported, then a step
    if spawn["ns"] + SLACK_NS < promote["ns"] + TAKEOVER_GRACE_NS:        # not ended by the grace
        assert spawn["ns"] > rec["step_received_ns"], (
            f"replacement spawned {(rec['step_received_ns'] - spawn['ns']) / 1e6:.1f} ms before the "
            f"promoted executor's first step (takeover reported "
            f"{(rec['step_received_ns'] - rec['received_ns']) / 1e6:.1f} ms before that step)")

    # Nothing running at the kill: no step comes, the grace ends the wait and a standby is spawned.
    killed = sc.wait_steady()
    os.kill(killed["pid"], signal.SIGKILL)
    fence, promote, spawn, st = _failover(sc, killed)
    rec = _record(st, fence["fenced_epoch"])
    assert "step_received_ns" not in rec and spawn["ns"] > rec["received_ns"]
    assert spawn["ns"] < promote["ns"] + TAKEOVER_GRACE_NS + GRACE_MARGIN_NS
    sc.wait_steady(timeout=30)
