"""Sampled requests under vLLM keyed by (seed, position) (kvhold.vllm_bridge.sampling): a
request resubmitted with its generated prefix as prompt continues exactly as the
uninterrupted request did, which vLLM's own per-request generator does not do."""
import os

import pytest

from tests.vllm_bridge.conftest import SKIP, STARTUP_S

pytestmark = [SKIP, pytest.mark.timeout(STARTUP_S)]


def test_a_resubmitted_sampled_request_continues_identically(tiny_model, vllm_env):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from kvhold.vllm_bridge.sampling import KeyedSampling, extra_args

    llm = LLM(model=str(tiny_model), dtype="float32", enforce_eager=True, max_model_len=256, block_size=32,
              num_gpu_blocks_override=32, enable_prefix_caching=False, seed=0,
              logits_processors=[KeyedSampling])
    prompt, cut = list(range(2, 40)), 12
    styles = [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, top_k=20)]

    def run(prompts, generated, max_tokens, keyed=True):
        params = [SamplingParams(max_tokens=m, seed=7, ignore_eos=True, detokenize=False,
                                 extra_args=extra_args(7 + i, g) if keyed else None, **styles[i])
                  for i, (g, m) in enumerate(zip(generated, max_tokens))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    whole = run([prompt] * 3, [0] * 3, [30] * 3)
    again = run([prompt] * 3, [0] * 3, [30] * 3)
    assert whole == again                                            # reproducible
    tails = run([prompt + w[:cut] for w in whole], [cut] * 3, [30 - cut] * 3)
    assert tails == [w[cut:] for w in whole]                         # the continuation is the same
    # vLLM's own sampler restarts its stream on resubmission
    own = run([prompt] * 3, [0] * 3, [30] * 3, keyed=False)
    own_tails = run([prompt + w[:cut] for w in own], [0] * 3, [30 - cut] * 3, keyed=False)
    assert own_tails != [w[cut:] for w in own]
