"""`--seed` (vLLM's): requests that give no seed get seeds drawn from it in admission order, so a
server started again serves the same requests the same way; each seed is journaled, as a
random one is."""
from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, ids, submit

UNSEEDED = [dict(prompt="Once upon a time", max_tokens=24, temperature=1.0, ignore_eos=True),
            dict(prompt="The sidecar keeps", max_tokens=24, temperature=0.8, ignore_eos=True)]


def _run(start_sidecar, tiny_model, *extra):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", *extra])
    sc.wait_steady(standbys=0)
    with sc.new_client(timeout=60) as client:
        out = [ids(wait_all(submit(client, [r]))) for r in UNSEEDED]      # one after the other
    sc.stop()
    return out


def test_a_server_seed_makes_unseeded_requests_reproducible(tiny_model, start_sidecar):
    first = _run(start_sidecar, tiny_model, "--seed", "7")
    assert _run(start_sidecar, tiny_model, "--seed", "7") == first
    assert _run(start_sidecar, tiny_model, "--seed", "8") != first
