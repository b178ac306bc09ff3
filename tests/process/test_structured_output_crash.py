"""Structured output and logit_bias across a real crash: requests constrained by a JSON schema, a
regex and a grammar, and one with a logit_bias, stream through a sidecar; the active executor SIGKILLs itself at a commit once every one
of them is mid-output (a fault point armed by this test), and every output equals the
uninterrupted run's (the replacement's matchers rebuilt from the committed tokens), which differs
from the same requests unconstrained."""
import json

from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, attach_pool, ids, submit, wait_decoding

# each output runs to well over 100 tokens: mid-output at the kill, however late it comes
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 300, "maxLength": 320},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPT = list(range(40, 72))
REQUESTS = [
    dict(prompt_ids=PROMPT, max_tokens=400, temperature=0.0, structured=("json", json.dumps(SCHEMA))),
    dict(prompt_ids=PROMPT[::-1], max_tokens=400, temperature=0.9, seed=8, structured=("regex", "[a-z ]{600}")),
    dict(prompt_ids=PROMPT[5:], max_tokens=400, temperature=0.0,
         structured=("grammar", 'root ::= item{60}\nitem ::= [a-z] [a-z] [a-z] ","')),
    dict(prompt_ids=PROMPT[9:], max_tokens=200, temperature=0.8, seed=3, ignore_eos=True,
         logit_bias={str(t): -100 if t % 2 else 3 for t in range(2, 400, 3)}),
]
FREE = [{k: v for k, v in r.items() if k not in ("structured", "logit_bias")} for r in REQUESTS]


def test_constrained_streams_continue_identically_after_a_sigkill(tiny_model, start_sidecar, tmp_path):
    armed = tmp_path / "armed"
    env = {"KVHOLD_FAULT": "commit_pages:1:kill", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS], env=env)
    sc.wait_steady()
    tables, _ = attach_pool(sc)
    with sc.new_client(timeout=90) as client:
        reference = ids(wait_all(submit(client, REQUESTS)))
        free = ids(wait_all(submit(client, FREE)))
        assert all(a != b for a, b in zip(reference, free))        # the grammars and the bias change every output
        streams = submit(client, REQUESTS)
        rids = [s.request_id for s in streams]
        wait_decoding(tables, rids, 2)
        armed.touch()                      # the executor kills itself at its next publication
        results = wait_all(streams)
    assert ids(results) == reference
    rec = sc.status()["recoveries"]
    assert len(rec) == 1 and rec[0]["requests_lost"] == 0
    assert rec[0]["requests_resumable"] + rec[0]["requests_damaged"] == 4      # all four ran at the kill
