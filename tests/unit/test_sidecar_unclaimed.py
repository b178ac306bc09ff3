"""Results kept for pickup (a request that ended with no client attached): kept in the order
they finished, expired from the oldest without visiting the rest, bounded in number, and
counted in the status while only the newest are listed."""
from types import SimpleNamespace

from kvhold.protocol import messages as m
from kvhold.frontend import restore as rs
from kvhold.frontend.restore import Restore


def keeper(monkeypatch, now):
    monkeypatch.setattr(rs, "now_ns", lambda: now[0])
    fe = SimpleNamespace(streams={})
    return Restore(fe, None, fingerprint="f", vocab_size=10, generation=1, started_ns=0,
                   send_client=lambda who, msg: True)


def park(r, rid):
    r.park(SimpleNamespace(request_id=rid, identity=b"c", text=["a"]), [5],
           m.Done(request_id=rid, finish_reason="length", prompt_tokens=1, completion_tokens=1))


def test_expiry_goes_from_the_oldest_and_stops_at_the_first_kept(monkeypatch):
    now = [0]
    r = keeper(monkeypatch, now)
    for rid in range(1, 6):
        now[0] = rid * 1_000_000_000
        park(r, rid)
    now[0] = int(rs.UNCLAIMED_KEEP_S * 1e9) + 3_000_000_000   # 1 and 2 are older than the keep time
    r.tick(now[0])
    assert list(r.unclaimed) == [3, 4, 5]


def test_the_number_kept_is_bounded_and_the_status_lists_the_newest(monkeypatch):
    now = [1]
    r = keeper(monkeypatch, now)
    monkeypatch.setattr(rs, "UNCLAIMED_MAX", 100)
    for rid in range(1, 151):
        park(r, rid)
    assert len(r.unclaimed) == 100 and next(iter(r.unclaimed)) == 51       # the oldest dropped
    status = r.status()
    assert status["unclaimed_total"] == 100
    assert [u["request_id"] for u in status["unclaimed"]] == list(range(151 - rs.UNCLAIMED_LISTED, 151))
