"""tools/bench_serve: what it makes of the chunk times a client saw."""
from tools.bench_serve import kill_summary, percentiles, summarise


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
