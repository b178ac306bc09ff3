"""The engine's steps' token counts (vLLM's iteration_tokens_total): the histogram the memory
owner keeps from StepDone messages, and its Prometheus form."""
from kvhold.serving.metrics import _iteration_tokens
from kvhold.sidecar.iteration_tokens import BUCKETS, IterationTokens


def test_steps_fall_in_vllms_buckets_and_render_cumulatively():
    h = IterationTokens()
    h.observe([1, 8, 9, 64, 20000])
    h.observe([0, 3])                 # a step of nothing is no step
    st = h.status()
    assert st["buckets"] == list(BUCKETS) and st["sum"] == 1 + 8 + 9 + 64 + 20000 + 3
    assert st["counts"][:2] == [1, 2] and st["counts"][2] == 1 and st["counts"][-1] == 1
    [family] = list(_iteration_tokens("m", st))
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples[("kvhold_iteration_tokens_bucket", "1.0")] == 1
    assert samples[("kvhold_iteration_tokens_bucket", "8.0")] == 3
    assert samples[("kvhold_iteration_tokens_bucket", "16384.0")] == 5
    assert samples[("kvhold_iteration_tokens_bucket", "+Inf")] == 6
    assert samples[("kvhold_iteration_tokens_count", None)] == 6
    assert list(_iteration_tokens("m", None)) == []
