"""Every kernel a serving step can launch is warmed before the executor serves: a mixed load
(prompts cut into prefill chunks of many sizes, every decode batch size from the served maximum
(64 rows, the default; 256, production's, with a 832-token step budget) down to 1,
log-probs and prompt log-probs, greedy and sampled rows) compiles nothing inside a step, on the
first active executor nor on the standby that takes over after a SIGKILL; a Triton compile in a
step is logged by the executor's compile watch (kvhold.executor.cuda.compile_watch), and this
test fails on that line. Both loads run whole, with one takeover between them. Also on an FP8
checkpoint, whose projections run on their own kernel (kvhold.executor.cuda.fp8_gemm)."""
import os
import signal

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMPILE_IN_STEP = "in a step (no warm-up launched it)"
# the served defaults (--max-batch 64, --max-batch-tokens 512, exact prefill) in the production dtype
FLAGS = ["--device", "cuda:0", "--backend", "cuda", "--compute-dtype", "bfloat16", "--max-seq-len", "1280",
         "--max-logprobs", "5", "--log-level", "INFO", "--restart-backoff-ms", "0,0"]
# prompt lengths around every chunk and page boundary; outputs of 1 to `rows` tokens, so that the
# batch shrinks one row at a time from `rows` to 1 (every decode bucket)
LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 200, 255, 256, 257, 300,
           383, 447, 448, 449, 500, 511, 512, 513, 700, 900]


def _load(rows):
    out = []
    for i in range(rows):
        n = LENGTHS[i % len(LENGTHS)]
        r = dict(prompt_ids=[2 + (i * 7 + j) % 500 for j in range(n)], max_tokens=1 + i, ignore_eos=True,
                 temperature=0.0 if i % 3 == 0 else 0.8, seed=i)
        if i % 4 == 1:
            r["top_p"], r["top_k"] = 0.9, 40
        if i % 5 == 2:
            r["logprobs"] = 5
        if i % 7 == 3:
            r["prompt_logprobs"] = 3
        out.append(r)
    return out


# the demo model; Llama-3-8B's layer shapes at the default batch and at production's, and in FP8
# (its projections on kvhold.executor.cuda.fp8_gemm)
@pytest.mark.parametrize("preset,rows,quant", [("tiny", 64, None), ("llama3-8b-4l", 64, None),
                                               ("llama3-8b-4l", 256, None), ("llama3-8b-4l", 64, "fp8-dynamic")])
def test_a_mixed_load_compiles_nothing_inside_a_step_before_or_after_a_takeover(tiny_model, tmp_path, preset,
                                                                               rows, quant):
    from kvhold.client.client import wait_all
    from kvhold.testing.make_model import build
    from kvhold.testing.sidecar_process import SidecarProcess

    model = tiny_model if preset == "tiny" else build(tmp_path / "model", preset, device="cuda", quant=quant,
                                                      progress=False)
    log = tmp_path / "sidecar.log"
    batch = [] if rows == 64 else ["--max-batch", str(rows), "--max-batch-tokens", "832"]
    with SidecarProcess(["--model", str(model), *FLAGS, *batch], log_path=log) as sc:
        active = sc.wait_steady(timeout=600)
        with sc.new_client(timeout=300) as client:
            first = wait_all([client.generate(**r) for r in _load(rows)])
            os.kill(active["pid"], signal.SIGKILL)           # the standby serves the same load
            sc.wait_for(lambda st: any(e["role"] == "active" and e["pid"] != active["pid"]
                                       for e in st["executors"]), timeout=120)
            second = wait_all([client.generate(**r) for r in _load(rows)])
        for results in (first, second):
            assert [len(r.token_ids) for r in results] == [r["max_tokens"] for r in _load(rows)]
        recoveries = sc.status()["recoveries"]
        assert len(recoveries) == 1 and recoveries[0]["requests_lost"] == 0
    compiled = [line for line in log.read_text().splitlines() if COMPILE_IN_STEP in line]
    assert not compiled, "\n".join(compiled)
