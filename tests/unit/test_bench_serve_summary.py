"""tools/bench_serve: what it makes of the chunk times a client saw, the lengths it draws and
the floor it sets beside them."""
import argparse

import pytest

from tools.bench_serve import kill_summary, length_range, percentiles, request_bodies, summarise, workload_floor


def stream(chunks, t0=0.0, tokens=None, text="x", error=None):
    return {"t0": t0, "chunks": chunks, "completion_tokens": len(chunks) if tokens is None else tokens,
            "text": text, "error": error}


def test_level_figures():
    rs = [stream([0.1, 0.11, 0.13]), stream([0.2, 0.25], t0=0.05, tokens=3)]
    s = summarise(rs, wall=1.0, max_tokens=3)
    assert s["ttft_ms"]["p50"] in (100.0, 150.0) and s["ttft_ms"]["max"] == 150.0
    assert s["itl_ms"]["n"] == 3 and s["itl_ms"]["max"] == 50.0
    assert s["completion_tokens"] == 6 and s["content_chunks"] == 5 and s["chunks_per_token"] == round(5 / 6, 4)
    assert s["not_max_tokens"] == 0 and s["errors"] == 0 and s["output_tokens_per_s"] == 6.0
    assert percentiles([]) is None


def test_kill_figures():
    rs = [stream([0.0, 0.01, 0.02, 0.2, 0.21], text="a"), stream([0.0, 0.4, 0.41], text="b")]
    k = kill_summary(rs, 0.05, [{"text": "a"}, {"text": "different"}])
    assert k["longest_gap_ms"] == 400.0                       # the second stream's first gap
    assert k["gap_across_kill_ms"]["max"] == 400.0 and k["gap_across_kill_ms"]["n"] == 2
    assert k["kill_to_next_chunk_ms"]["p50"] in (150.0, 350.0) and k["kill_to_next_chunk_ms"]["max"] == 350.0
    assert k["longest_gap_not_across_kill_ms"] == 10.0
    assert k["chunk_ms_from_kill"][0] == [-50.0, -40.0, -30.0, 150.0, 160.0]
    assert (k["identical_to_uninterrupted"], k["compared"]) == (1, 2)
    assert kill_summary(rs, None, None) == {"killed": False}


def test_per_request_max_tokens():
    rs = [stream([0.1, 0.2]), stream([0.1, 0.2, 0.3])]
    assert summarise(rs, wall=1.0, max_tokens=[2, 3])["not_max_tokens"] == 0
    assert summarise(rs, wall=1.0, max_tokens=[3, 3])["not_max_tokens"] == 1


def test_lengths_are_one_or_a_range_drawn_per_request():
    assert length_range("512") == (512, 512) and length_range("128,512") == (128, 512)
    for bad in ("0", "512,128", "a", "1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            length_range(bad)
    bodies = request_bodies(200, (128, 512), (128, 384), 1000, 0, "m")
    prompts, outs = [len(b["prompt"]) for b in bodies], [b["max_tokens"] for b in bodies]
    assert 128 <= min(prompts) < 200 and 440 < max(prompts) <= 512 and len(set(prompts)) > 100
    assert 128 <= min(outs) < 160 and 350 < max(outs) <= 384
    assert bodies == request_bodies(200, (128, 512), (128, 384), 1000, 0, "m")       # the seed decides
    assert {len(b["prompt"]) for b in request_bodies(5, 16, 4, 1000, 0, "m")} == {16}


def test_the_floor_is_prefill_at_the_peak_plus_decode_steps_at_the_bandwidth():
    bodies = [{"prompt": [1] * 100, "max_tokens": 10}, {"prompt": [1] * 300, "max_tokens": 30}]
    f = workload_floor(bodies, 2, weight_bytes=1000, kv_bytes_per_token=2, params=50, peak_flops=1e6, bandwidth=1e4)
    assert f["prefill_s"] == 2 * 50 * 400 / 1e6                           # 0.04 s
    mean_context = ((100 + 5) * 10 + (300 + 15) * 30) / 40
    step = (1000 + 2 * mean_context * 2) / 1e4
    assert f["decode_step_ms"] == round(step * 1e3, 3) and f["decode_s"] == round(20 * step, 4)
    assert f["output_tokens_per_s"] == round(40 / (0.04 + 20 * step), 1)
