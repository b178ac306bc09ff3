"""tools/bench_mirror on CPU with the tiny model: every batch gets its three rows, the mirror
holds exactly the engine's committed bytes, and the three engines produce the same tokens."""
import json

from tools import bench_mirror


def test_bench_mirror_rows(tiny_model, tmp_path):
    out = tmp_path / "mirror.json"
    argv = ["--model", str(tiny_model), "--device", "cpu", "--batches", "1,3", "--steps", "3",
            "--rounds", "2", "--prompt-len", "20", "--kv-pages", "64", "--max-seq-len", "128",
            "--out", str(out)]
    assert bench_mirror.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python -m tools.bench_mirror " + " ".join(argv)
    rows = {(r["batch"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(b, m) for b in (1, 3) for m in bench_mirror.MODES}
    for batch in (1, 3):
        for mode in bench_mirror.MODES:
            r = rows[batch, mode]
            assert r["step_ms"] > 0 and len(r["round_step_ms"]) == 2 and r["tokens_identical"]
        foreign = rows[batch, "foreign"]
        assert {"overhead_vs_native_pct", "overhead_vs_no_commit_pct"} <= set(foreign)
        assert foreign["pages_published_per_step"] == batch          # one new row per request
        check = foreign["mirror_check"]
        assert check["pages"] >= batch and check["bytes_match"] and check["checksums_match"]


def test_bench_mirror_host(tmp_path):
    """--host: the mirror's host cost per decode step on each path, no model needed."""
    out = tmp_path / "host.json"
    argv = ["--host", "--batches", "1,4", "--steps", "40", "--out", str(out)]
    assert bench_mirror.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] == "python -m tools.bench_mirror " + " ".join(argv)
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    for r in result["rows"]:
        assert 0 < r["publish_us"] and 0 < r["fast_us"] and 0 < r["general_us"]
