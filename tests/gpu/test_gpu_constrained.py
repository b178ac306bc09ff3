"""What a request can carry beyond plain sampling, on the CUDA engine: a JSON schema, a regex and a
grammar (llguidance's masks), a logit_bias, vLLM's penalties, min_p and min_tokens, each batched
with a free-running request (which keeps the CUDA graph path). The active executor is SIGKILLed
mid-stream three times (on the first event, and later); every output equals the uninterrupted
run's, the constraints hold, and the constrained outputs differ from the same requests free."""
import json
import re

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = ["--max-seq-len", "512", "--max-batch", "16", "--max-batch-tokens", "256", "--prefill-chunk", "64",
         "--log-level", "INFO", "--restart-backoff-ms", "0,0", "--max-logprobs", "5"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 40, "maxLength": 60},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPT = list(range(40, 72))
REQUESTS = [
    dict(prompt_ids=PROMPT, max_tokens=120, temperature=0.0, structured=("json", json.dumps(SCHEMA))),
    dict(prompt_ids=PROMPT[::-1], max_tokens=120, temperature=0.9, seed=8, structured=("regex", "[a-z ]{90}")),
    dict(prompt_ids=PROMPT[5:], max_tokens=120, temperature=0.0, logprobs=3,
         structured=("grammar", 'root ::= item{20}\nitem ::= [a-z] [a-z] [a-z] ","')),
    dict(prompt_ids=PROMPT[9:], max_tokens=80, temperature=0.8, seed=3, ignore_eos=True,
         logit_bias={str(t): -100 if t % 2 else 3 for t in range(2, 400, 3)}),
    dict(prompt_ids=PROMPT[3:], max_tokens=80, temperature=0.7, seed=5, ignore_eos=True,
         presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05, logprobs=2),
    dict(prompt_ids=PROMPT[7:], max_tokens=60, min_tokens=50, temperature=0.0),   # stop ids: its free output's
    dict(prompt_ids=PROMPT[1:], max_tokens=80, temperature=0.0, ignore_eos=True),          # free: graph path
]
CONSTRAINED = ("structured", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty",
               "min_p", "min_tokens")


def outcome(results):
    return [(r.token_ids, r.logprobs, r.finish_reason) for r in results]


def test_constrained_requests_survive_kills_on_the_gpu(tiny_model, tmp_path):
    pytest.importorskip("llguidance")
    from kvhold.client.client import wait_all
    from tests.gpu.helpers import kill_active_at
    from kvhold.testing.sidecar_process import SidecarProcess

    cuda = ["--model", str(tiny_model), "--device", "cuda:0", "--backend", "cuda", *FLAGS]
    with SidecarProcess(cuda, log_path=tmp_path / "sidecar.log") as sc:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=120) as client:
            # the min_tokens request stops on its free output's 3rd to 5th tokens: free, it stops at once
            probe = client.generate(prompt_ids=PROMPT[7:], max_tokens=5, temperature=0.0, ignore_eos=True)
            stop = sorted(set(probe.result().token_ids[2:]))
            requests = [dict(r) for r in REQUESTS]
            requests[5]["stop_token_ids"] = stop
            results = wait_all([client.generate(**r) for r in requests])
            reference = outcome(results)
            free = outcome(wait_all([client.generate(**{k: v for k, v in r.items() if k not in CONSTRAINED})
                                     for r in requests]))
            for trial, threshold in enumerate((1, 60, 150)):
                sc.wait_steady(timeout=600)
                got = outcome(wait_all([client.generate(**r) for r in requests], kill_active_at(sc, threshold)))
                assert got == reference, f"trial {trial}"
        recoveries = sc.status()["recoveries"]
    assert len(recoveries) == 3 and all(r["requests_lost"] == 0 for r in recoveries)
    assert all(a[0] != b[0] for a, b in zip(reference[:6], free[:6]))     # each constraint changed its output
    assert reference[6] == free[6]
    doc = json.loads(results[0].text)
    assert set(doc) == {"name", "n"} and 40 <= len(doc["name"]) <= 60
    assert re.fullmatch("[a-z ]{90}", results[1].text)
    assert re.fullmatch("([a-z]{3},){20}", results[2].text)
    banned = {t for t in range(2, 400, 3) if t % 2}
    assert not banned & set(reference[3][0])
    tokens = reference[5][0]
    assert len(tokens) >= 50 and not set(stop) & set(tokens[:50])
    assert free[5][2] == "stop" and len(free[5][0]) <= 3
