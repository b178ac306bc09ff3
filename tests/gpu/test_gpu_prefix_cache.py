"""The prefix cache on the CUDA engine with exact prefill: requests that start on cached pages
(the hit ending in the middle of a 64-token prefill chunk) give the tokens and log-probs of a
sidecar without the cache, bit for bit, and so do they when the active executor is SIGKILLed
mid-stream (stopped by a fault point first, so that every request is running). Log-probs are
compared between runs whose batches hold the same requests: a decode step's logits on CUDA may
differ in the last bit with the batch's size (the tokens do not here)."""
import os
import signal

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLAGS = ["--device", "cuda:0", "--backend", "cuda", "--max-seq-len", "512", "--max-batch", "16",
         "--max-batch-tokens", "256", "--prefill-chunk", "64", "--log-level", "INFO",
         "--restart-backoff-ms", "0,0", "--max-logprobs", "5", "--lease-ms", "5000"]
SYSTEM = [3 + (17 * j) % 400 for j in range(160)]          # 10 full pages: the hit ends inside chunk 3
WARM = dict(prompt_ids=SYSTEM + [5], max_tokens=4, temperature=0.0, ignore_eos=True)
REQUESTS = [dict(prompt_ids=SYSTEM + [40 + (i * 7 + j) % 300 for j in range(5 + 23 * i)], max_tokens=150,
                 temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True, logprobs=3) for i in range(8)]


def outcome(results):
    return [(r.token_ids, r.logprobs) for r in results]


def test_cache_hits_are_bit_exact_on_the_gpu_and_survive_a_kill(tiny_model, tmp_path):
    """Each request alone (so that the batches are the same in both sidecars and only the hit
    differs): with the cache, the tokens and log-probs of a sidecar without it. Then all eight at
    once, uninterrupted and across a SIGKILL of the active executor, on the same cache."""
    from kvhold.client.client import wait_all
    from kvhold.testing.sidecar_process import SidecarProcess

    def one_by_one(client):
        return [wait_all([client.generate(**r)])[0] for r in REQUESTS]

    base = ["--model", str(tiny_model), *FLAGS]
    with SidecarProcess([*base, "--no-enable-prefix-caching"], log_path=tmp_path / "plain.log") as sc:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=120) as client:
            warm_ref = outcome(wait_all([client.generate(**WARM)]))
            reference = outcome(one_by_one(client))
    armed = tmp_path / "armed"
    env = {"KVHOLD_FAULT": "commit_pages:1:stop", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    with SidecarProcess([*base, "--enable-prefix-caching"], log_path=tmp_path / "cached.log", env=env) as sc:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=120) as client:
            assert outcome(wait_all([client.generate(**WARM)])) == warm_ref
            hits = one_by_one(client)
            assert outcome(hits) == reference                                # bit for bit
            assert [r.cached_tokens for r in hits] == [160] * 8
            together = outcome(wait_all([client.generate(**r) for r in REQUESTS]))
            assert [ids for ids, _ in together] == [ids for ids, _ in reference]
            pid = sc.wait_steady(timeout=600)["pid"]
            streams = [client.generate(**r) for r in REQUESTS]
            armed.touch()                 # the executor stops at its next publication, mid-stream
            _wait_stopped(pid)
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
            resumed = outcome(wait_all(streams))
            # the tokens exactly; the log-probs as close as float32 rounding: a takeover changes
            # which requests share a decode step, whose logits may differ in the last bit with it
            assert [ids for ids, _ in resumed] == [ids for ids, _ in together]
            for (_, got), (_, want) in zip(resumed, together):
                assert np.allclose([t.logprob for t in got], [t.logprob for t in want], rtol=1e-5, atol=1e-6)
        rec = sc.status()["recoveries"][-1]
        assert rec["requests_lost"] == 0 and rec["pages_bad"] == 0


def _wait_stopped(pid: int, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.01)
