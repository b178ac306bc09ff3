"""A promoted executor SIGKILLed in the middle of its own takeover (real processes, a fault point
between the takeover's steps: after it released or quarantined the pages no request keeps, and
after it copied the partially filled tail pages away from the dead writer). The next executor
takes over from tables half repaired: every request completes with the uninterrupted run's
tokens, and none is lost (each journal page list names only pages whose records still hold
that request's KV)."""
from __future__ import annotations

import os
import signal

import pytest

from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, ids, submit, wait_until


@pytest.mark.parametrize("point", ["takeover_cleared", "takeover_tails"])
def test_a_death_inside_a_takeover_loses_no_request(tiny_model, reference, start_sidecar, tmp_path, point):
    armed, fired = tmp_path / "armed", tmp_path / "fired"
    env = {"KVHOLD_FAULT": f"{point}:1:kill", "KVHOLD_FAULT_IF": str(armed), "KVHOLD_FAULT_ONCE": str(fired)}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS], env=env)
    first = sc.wait_steady(standbys=1)["pid"]
    armed.touch()                  # the active one's own (first) takeover is behind it
    with sc.new_client(timeout=60) as client:
        streams = submit(client)
        seen = [0]

        def on_event(stream, event):
            seen[0] += 1
            if seen[0] == 8:       # every short prompt's KV still in its first, partially filled page
                os.kill(first, signal.SIGKILL)

        assert ids(wait_all(streams, on_event)) == reference
    # the promoted executor died inside its takeover (waited for: the streams may end first)
    wait_until(fired.exists, 60, what="the promoted executor's death inside its takeover")
    # the one that died reported nothing: the record is its successor's, from the tables it left
    recoveries = sc.wait_for(lambda st: st["recoveries"], timeout=60)
    assert all(r["requests_lost"] == 0 and r["requests_damaged"] == 0 for r in recoveries), recoveries
