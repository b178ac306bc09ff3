"""min_tokens across a crash, with real processes: requests whose stop ids the model would
pick at once (greedy; sampled with ignore_eos; EOS masked to the end) continue after the
active executor is SIGKILLed mid-stream exactly as an uninterrupted run, and no stop id or
EOS ends one before its min_tokens."""
import os
import signal

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess
from tests.process.helpers import FLAGS, LONG_PROMPT, submit, wait_stopped

GREEDY = dict(prompt_ids=LONG_PROMPT[:40], max_tokens=40, temperature=0.0)
SAMPLED = dict(prompt="Once upon a time", max_tokens=40, temperature=0.9, seed=4, ignore_eos=True)
TO_THE_END = dict(prompt="The sidecar keeps the memory", max_tokens=36, min_tokens=36, temperature=0.8, seed=7)


def outcome(results):
    return [(r.token_ids, r.finish_reason) for r in results]


def test_min_tokens_continue_identically_after_the_active_executor_is_killed(tiny_model, start_sidecar, tmp_path):
    with SidecarProcess(["--model", str(tiny_model), *FLAGS, "--standbys", "0"]) as sc:
        sc.wait_steady(standbys=0)
        with sc.new_client(timeout=60) as client:
            plain = [r.token_ids for r in wait_all(submit(client, [GREEDY, SAMPLED]))]
            # the first token each picks without a minimum is its stop id: it would end it at once
            requests = [dict(GREEDY, stop_token_ids=[plain[0][0]], min_tokens=25),
                        dict(SAMPLED, stop_token_ids=[plain[1][0]], min_tokens=20), TO_THE_END]
            reference = outcome(wait_all(submit(client, requests)))
            unmasked = outcome(wait_all(submit(client, [dict(r, min_tokens=0) for r in requests[:2]])))
    assert [len(ids) for ids, _ in unmasked] == [1, 1] and {why for _, why in unmasked} == {"stop"}
    for (ids, _), r in zip(reference, requests):
        assert len(ids) >= r["min_tokens"]
        assert not set(ids[:r["min_tokens"]]) & set(r.get("stop_token_ids", ()))

    # mid-stream: the active executor stops itself at its 5th commit (each request has 20 or more
    # tokens to come), however slowly this test follows, and is SIGKILLed there
    env = {"KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--lease-ms", "30000"], env=env)
    pid = sc.wait_steady()["pid"]
    with sc.new_client(timeout=60) as client:
        streams = submit(client, requests)
        wait_stopped(pid, 60)
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        assert outcome(wait_all(streams)) == reference
    recoveries = sc.status()["recoveries"]
    assert len(recoveries) == 1
    assert recoveries[0]["requests_lost"] + recoveries[0]["requests_damaged"] == 0
