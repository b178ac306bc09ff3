"""Log-probs on the CUDA engine: an executor SIGKILLed mid-stream (and mid-prefill) leaves every
token, log-prob and prompt log-prob equal to an uninterrupted run's; greedy tokens are the most
likely, each top list is sorted, and the values agree with the CPU float64 engine's."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = ["--max-seq-len", "512", "--max-batch", "16", "--max-batch-tokens", "256", "--prefill-chunk", "64",
         "--log-level", "INFO", "--restart-backoff-ms", "0,0", "--max-logprobs", "5"]
REQUESTS = [dict(prompt_ids=list(range(2, 2 + 30 * (i + 1))), max_tokens=40, temperature=0.8 if i % 2 else 0.0,
                 seed=i, ignore_eos=True, logprobs=5 if i % 2 else 2, prompt_logprobs=3) for i in range(6)]


def outcome(results):
    return [(r.token_ids, r.logprobs, r.prompt_logprobs) for r in results]


def test_logprobs_survive_kills_on_the_gpu_and_match_the_cpu_engine(tiny_model, tmp_path):
    from kvhold.client.client import wait_all
    from tests.gpu.helpers import kill_active_at
    from kvhold.testing.sidecar_process import SidecarProcess

    cuda = ["--model", str(tiny_model), "--device", "cuda:0", "--backend", "cuda", *FLAGS]
    with SidecarProcess(cuda, log_path=tmp_path / "sidecar.log") as sc:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=120) as client:
            reference = outcome(wait_all([client.generate(**r) for r in REQUESTS]))
            for trial, threshold in enumerate((1, 60, 150)):
                sc.wait_steady(timeout=600)
                got = outcome(wait_all([client.generate(**r) for r in REQUESTS], kill_active_at(sc, threshold)))
                assert got == reference, f"trial {trial}"
        assert all(r["requests_lost"] == 0 for r in sc.status()["recoveries"])
    for (tokens, lps, prompt), r in zip(reference, REQUESTS):
        assert len(lps) == len(tokens) and len(prompt) == len(r["prompt_ids"])
        for lp in lps:
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True) and lp.logprob <= 0
            if r["temperature"] == 0:
                assert lp.top[0][0] == lp.token_id
    with SidecarProcess(["--model", str(tiny_model), *FLAGS], log_path=tmp_path / "cpu.log") as sc:
        sc.wait_steady(timeout=300)
        with sc.new_client(timeout=120) as client:
            cpu = outcome(wait_all([client.generate(**r) for r in REQUESTS]))
    for (_, _, gpu_prompt), (_, _, cpu_prompt) in zip(reference, cpu):   # same prompt: same distribution
        a = torch.tensor([e.logprob for e in gpu_prompt[1:]])
        b = torch.tensor([e.logprob for e in cpu_prompt[1:]])
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)
