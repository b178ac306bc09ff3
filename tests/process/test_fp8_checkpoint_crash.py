"""An FP8 checkpoint (compressed-tensors FP8-Dynamic, as make_model --quant writes it) served by a
real sidecar and its executors: the weights stay float8_e4m3fn with their scales in the sidecar's
region, and an executor SIGKILLed mid-stream is taken over by the standby, which maps the same
FP8 bytes, with every token of the continuation the uninterrupted run's."""
import pytest

from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.model_spec import ModelSpec
from kvhold.testing.make_model import build
from tests.process.helpers import FLAGS, greedy_across_a_kill, stop_at_step

NEW = 120
PROMPT = [1, 37, 250, 11, 402, 98, 7, 301, 55, 4, 190, 66, 23, 140]


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fp8") / "tiny-fp8", "tiny", quant="fp8-dynamic", progress=False)


def test_fp8_weights_served_and_taken_over_token_for_token(fp8_model, start_sidecar, tmp_path):
    # once armed, the executor stops itself at the 6th step of the second run (a few tokens in,
    # most of its 120 to come, however far the engine runs ahead of this client), then is SIGKILLed
    armed, env = stop_at_step(tmp_path, PROMPT[-1], 6)
    sc = start_sidecar(["--model", str(fp8_model), *FLAGS], env=env)
    sc.wait_steady()
    status = sc.status()
    spec = ModelSpec.from_dir(fp8_model)
    manifest = build_manifest(fp8_model, spec)
    assert status["weights"]["state"] == "sealed" and status["weights"]["fingerprint"] == manifest.fingerprint
    assert {e.dtype for e in manifest.entries if e.name in spec.fp8_weights()} == {"float8_e4m3fn"}
    with sc.new_client(timeout=60) as client:
        want = client.generate(prompt_ids=PROMPT, max_tokens=NEW, temperature=0.0, ignore_eos=True).result()
        want = want.token_ids
        assert len(want) == NEW and len(set(want)) > 5
        seen, rec = greedy_across_a_kill(sc, client, armed, PROMPT, NEW)
        assert seen == want
    assert rec["requests_resumable"] == 1 and rec["requests_lost"] + rec["requests_damaged"] == 0
