"""The driver's Xid for a CUDA fault the executor already reported does not restart its successor."""
from kvhold.protocol.leases import now_ns
from kvhold.sidecar.config import HealthConfig
from kvhold.sidecar.health import Action, HealthEvent, HealthSignal
from kvhold.sidecar.health_responder import CONTEXT_XID_WINDOW_NS, HealthResponder


def _responder(faults):
    restarted = []
    r = HealthResponder(HealthConfig(source="off"), "cpu", post=lambda fn: fn(),
                        restart_executor=lambda reason: restarted.append(reason) or 4242,
                        close_admissions=lambda by, reason: None, open_admissions=lambda by: None,
                        admissions_closed=lambda: {},
                        recent_context_fault=lambda window: next(
                            (pid for ns, pid in faults if now_ns() - ns <= window), None))
    return r, restarted


def _xid(xid):
    sig = HealthSignal(kind="xid", detail={"xid": xid}, ns=now_ns())
    return HealthEvent(signal=sig, action=Action.RESTART_EXECUTOR, reason=f"Xid {xid}")


def test_an_xid_soon_after_a_reported_context_fault_is_attributed_and_restarts_nothing():
    r, restarted = _responder([(now_ns(), 777)])
    r.respond(_xid(31))
    assert restarted == []
    assert r.actions_taken[-1]["action"] == "none" and r.actions_taken[-1]["attributed_to_pid"] == 777


def test_an_xid_with_no_reported_fault_or_long_after_one_restarts_the_active_executor():
    r, restarted = _responder([(now_ns() - CONTEXT_XID_WINDOW_NS - 1, 777)])
    r.respond(_xid(13))
    assert len(restarted) == 1 and r.actions_taken[-1]["executor_pid"] == 4242


def test_an_xid_that_is_not_confined_to_a_context_is_never_attributed():
    r, restarted = _responder([(now_ns(), 777)])
    r.respond(_xid(109))                # a context-switch timeout: restart, whatever died before
    assert len(restarted) == 1
