"""Penalties and min_p across a real crash: requests with vLLM's repetition, presence and
frequency penalties and min_p stream through a sidecar; the active executor SIGKILLs itself at a
commit once every one of them decodes (a fault point armed by this test), and every output equals
the uninterrupted run's, which differs from the same requests without the penalties."""
from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, attach_pool, ids, submit, wait_decoding

PROMPT = list(range(40, 72))
REQUESTS = [
    dict(prompt_ids=PROMPT, max_tokens=120, temperature=0.0, repetition_penalty=1.4, ignore_eos=True),
    dict(prompt_ids=PROMPT[::-1], max_tokens=120, temperature=0.0, frequency_penalty=0.9, presence_penalty=0.3,
         ignore_eos=True),
    dict(prompt_ids=PROMPT[5:], max_tokens=120, temperature=0.9, seed=8, presence_penalty=1.2, min_p=0.05,
         ignore_eos=True),
]
PLAIN = [{k: v for k, v in r.items() if "penalty" not in k and k != "min_p"} for r in REQUESTS]


def test_penalized_streams_continue_identically_after_a_sigkill(tiny_model, start_sidecar, tmp_path):
    armed = tmp_path / "armed"
    env = {"KVHOLD_FAULT": "commit_pages:1:kill", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--no-enable-prefix-caching"], env=env)
    sc.wait_steady()
    tables, _ = attach_pool(sc)
    with sc.new_client(timeout=90) as client:
        reference = ids(wait_all(submit(client, REQUESTS)))
        plain = ids(wait_all(submit(client, PLAIN)))
        assert all(a != b for a, b in zip(reference, plain))        # the penalties change every output
        streams = submit(client, REQUESTS)
        rids = [s.request_id for s in streams]
        wait_decoding(tables, rids, 2)
        armed.touch()                      # the executor kills itself at its next publication
        results = wait_all(streams)
    assert ids(results) == reference
    rec = sc.status()["recoveries"]
    assert len(rec) == 1 and rec[0]["requests_lost"] == 0
    assert rec[0]["requests_resumable"] + rec[0]["requests_damaged"] == 3      # all three ran at the kill
