"""The serving and prefill benchmarks on CPU, and the stream a covering tokenizer gives: a real
`kvhold serve` with the llama3-tiny preset (tiny shapes, a 4,096-id vocabulary covered by the
preset's tokenizer as llama3-8b's 128,256 are) streams one HTTP chunk per generated token."""
import json
import subprocess
import sys

import httpx
import pytest

from kvhold.client.client import Client
from kvhold.testing.make_model import build
from kvhold.testing.serve_process import http_client
from tools.bench_serve import Server, stream_one


@pytest.fixture(scope="module")
def llama3_tiny(tmp_path_factory):
    return build(tmp_path_factory.mktemp("models") / "llama3-tiny", "llama3-tiny", progress=False)


@pytest.fixture(scope="module")
def server(llama3_tiny, tmp_path_factory):
    srv = Server(llama3_tiny, "cpu", 256, ["--lease-ms", "3000"], tmp_path_factory.mktemp("log") / "serve.log",
                 start_timeout=120)
    yield srv
    srv.stop()


def test_http_stream_is_one_chunk_per_token(server, llama3_tiny):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(llama3_tiny / "tokenizer.json"))
    specials = {tok.token_to_id("<s>"), tok.token_to_id("</s>")}
    n = 48
    prompt = "The sidecar keeps the memory of every request"
    with Client.for_instance(server.instance, server.root, timeout=60) as client:
        ids = client.generate(prompt, max_tokens=n, temperature=0.0, ignore_eos=True).result().token_ids
    assert len(ids) == n
    model = http_client().get(server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}

    async def go():
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as c:
            return await stream_one(c, body)
    import asyncio
    res = asyncio.run(go())
    assert res["error"] is None and res["completion_tokens"] == n
    assert len(res["chunks"]) == sum(1 for i in ids if i not in specials) >= n - 2
    assert res["text"] == tok.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_bench_serve_writes_its_figures(llama3_tiny, tmp_path):
    out = tmp_path / "serve.json"
    # streams long enough that the kill (a third of the way through, as the client sees it) still
    # finds them running in the engine, however far it runs ahead of this client
    n = 96
    cmd = [sys.executable, "-m", "tools.bench_serve", "--model", str(llama3_tiny), "--device", "cpu",
           "--concurrency", "1,3", "--rounds", "1", "--prompt-len", "24", "--max-tokens", str(n),
           "--kill-concurrency", "3", "--serve-args", "--lease-ms 3000", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m tools.bench_serve --model")
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for lv in result["levels"]:
        assert lv["errors"] == 0 and lv["not_max_tokens"] == 0 and lv["completion_tokens"] == lv["requests"] * n
        assert lv["ttft_ms"]["p50"] > 0 and lv["itl_ms"]["n"] > 0 and lv["output_tokens_per_s"] > 0
        assert lv["chunks_per_token"] > 0.9          # one chunk per token but for a special id
    kill = result["kill"]
    assert kill["killed"] and kill["errors"] == 0 and kill["not_max_tokens"] == 0
    assert kill["active_pid_after"] not in (None, kill["victim_pid"])
    assert kill["longest_gap_ms"] >= kill["gap_across_kill_ms"]["max"] > 0
    assert kill["identical_to_uninterrupted"] == kill["compared"] == 3
    assert kill["recovery_record"] is not None
    assert result["serve_exit_code"] == 0


@pytest.mark.slow
def test_bench_prefill_writes_a_row_per_setting(llama3_tiny, tmp_path):
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, "-m", "tools.bench_prefill", "--model", str(llama3_tiny), "--device", "cpu",
           "--prompts", "32,80", "--concurrent", "1,2", "--repeats", "1", "--max-batch-tokens", "128",
           "--variant", "served:", "--variant", "chunk16:prefill_chunk=16,KVHOLD_BENCH_MARK=x", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"] == "python -m tools.bench_prefill " + " ".join(cmd[3:])
    assert "2*P*N" in result["flops_formula"]
    rows = result["rows"]
    assert [(r["variant"], r["prompt_tokens"], r["concurrent"]) for r in rows] == [
        (v, p, k) for v in ("served", "chunk16") for p in (32, 80) for k in (1, 2)]
    for r in rows:
        assert r["mfu"] > 0 and r["tokens_per_s"] > 0 and r["wall_s"] > 0
        assert r["prefill_chunk"] == (64 if r["variant"] == "served" else 16)   # 128 - max_batch 64
        assert r["chunks_per_prompt"] == -(-r["prompt_tokens"] // r["prefill_chunk"])
    assert result["variants"][1]["environment"]["KVHOLD_BENCH_MARK"] == "x"
