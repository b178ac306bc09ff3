"""A Gemma checkpoint as transformers writes it, served by a real sidecar and its executors:
the greedy tokens equal transformers' generate, and an executor SIGKILLed mid-stream is taken
over by the standby with every token the same (Gemma's alternating sliding-window and global
layers, each with its RoPE base, in the shared KV pool)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvhold.testing.make_model import train_tokenizer  # noqa: E402
from tests.process.helpers import FLAGS, greedy_across_a_kill, stop_at_step  # noqa: E402
from tests.unit.helpers import CASES, build_checkpoint, hf_greedy  # noqa: E402

NEW = 160


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    tok = train_tokenizer()
    classes, kwargs = CASES["gemma3_text"]
    model = build_checkpoint(path, tok, *classes(transformers), **{**kwargs, "sliding_window": 8})
    tok.save(str(path / "tokenizer.json"))
    prompt = tok.encode("The quick brown fox jumps over the lazy dog").ids
    with torch.no_grad():
        return path, prompt, hf_greedy(model, prompt, NEW)


@pytest.mark.slow      # a real kill and takeover: `pytest -m slow`
def test_gemma_served_and_taken_over_token_for_token(gemma, start_sidecar, tmp_path):
    path, prompt, want = gemma
    assert len(prompt) + NEW > 2 * 8               # past the sliding window
    # once armed, the executor stops itself at the 6th step of the second run (a few tokens in,
    # most of its 160 to come, however far the engine runs ahead of this client), then is SIGKILLed
    armed, env = stop_at_step(tmp_path, prompt[-1], 6)
    sc = start_sidecar(["--model", str(path), *FLAGS, "--max-seq-len", "256"], env=env)
    sc.wait_steady()
    with sc.new_client(timeout=60) as client:
        got = client.generate(prompt_ids=prompt, max_tokens=NEW, temperature=0.0, ignore_eos=True).result()
        assert got.token_ids == want
        seen, rec = greedy_across_a_kill(sc, client, armed, prompt, NEW)
        assert seen == want
    assert rec["requests_resumable"] == 1 and rec["requests_lost"] + rec["requests_damaged"] == 0
