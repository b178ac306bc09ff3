"""HTTP path vs SDK path on one `kvhold serve`, and the pause a streaming client sees in a failover.

    python -m tools.bench_http [--requests 20] [--max-tokens 128] [--concurrency 16] [--kills 10]

Starts `kvhold serve` with the demo model (CPU), then measures against the same sidecar:
* time to first token and decode tokens/s of one stream at a time, through the sync
  SDK (ZeroMQ) and through HTTP (/v1/completions, SSE, httpx);
* aggregate tokens/s with --concurrency streams at once, both paths;
* the stream pause: an HTTP stream whose active executor is SIGKILLed mid-stream; the
  pause is the longest gap between chunks from the kill on (chunks already in flight may
  arrive first), next to the median gap between chunks.
Writes bench/results/http_cpu.json with every raw sample.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvhold.client.client import Client, wait_all
from kvhold.testing.make_model import ensure_demo_model
from kvhold.testing.serve_process import ServeProcess

PROMPT = "The sidecar keeps the memory of every request"


def _rates(t0: float, arrivals: list[float], tokens: int) -> dict:
    decode_s = arrivals[-1] - arrivals[0]
    return {"ttft_ms": (arrivals[0] - t0) * 1e3,
            "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else None}


def sdk_single(client: Client, n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        arrivals = [time.perf_counter() for _ in client.generate(PROMPT, max_tokens=max_tokens, seed=i,
                                                                 ignore_eos=True)]
        out.append(_rates(t0, arrivals, len(arrivals)))
    return out


_HTTP: dict[str, httpx.Client] = {}


def http_stream(base: str, body: dict, on_chunk=None) -> tuple[float, list[float], str]:
    """One streamed completion on a kept-alive connection (as a real client keeps one)."""
    client = _HTTP.setdefault(base, httpx.Client(base_url=base, timeout=120))
    t0 = time.perf_counter()
    arrivals, text = [], []
    with client.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                piece = json.loads(line[6:])["choices"][0]
                if piece["finish_reason"] is None:
                    arrivals.append(time.perf_counter())
                    text.append(piece["text"])
                    if on_chunk:
                        on_chunk(len(arrivals))
    return t0, arrivals, "".join(text)


def http_single(base: str, n: int, max_tokens: int) -> list[dict]:
    out = []
    for i in range(n):
        body = dict(prompt=PROMPT, max_tokens=max_tokens, seed=i, ignore_eos=True, stream=True)
        t0, arrivals, _ = http_stream(base, body)
        out.append(_rates(t0, arrivals, len(arrivals)))
    return out


def sdk_concurrent(client: Client, n: int, max_tokens: int) -> float:
    t0 = time.perf_counter()
    results = wait_all([client.generate(PROMPT, max_tokens=max_tokens, seed=i, ignore_eos=True)
                        for i in range(n)])
    return sum(r.completion_tokens for r in results) / (time.perf_counter() - t0)


async def _http_concurrent(base: str, n: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        async def one(i):
            body = dict(prompt=PROMPT, max_tokens=max_tokens, seed=i, ignore_eos=True)
            return (await c.post("/v1/completions", json=body)).json()["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
        return tokens / (time.perf_counter() - t0)


def recovery_pauses(server: ServeProcess, kills: int, kill_at: int = 30) -> list[dict]:
    base = server.base
    out = []
    for k in range(kills):
        body = dict(prompt=PROMPT, max_tokens=200, seed=k, temperature=0.8, ignore_eos=True, stream=True)
        _, _, reference = http_stream(base, dict(body))
        victim = server.wait_healthy(standbys=1, timeout=120)["active_pid"]

        def on_chunk(i):
            if i == kill_at:
                os.kill(victim, signal.SIGKILL)
        _, arrivals, text = http_stream(base, body, on_chunk)
        gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
        out.append({"pause_ms": max(gaps[kill_at - 1:]), "median_gap_ms": statistics.median(gaps),
                    "identical": text == reference})
    return out


def _summary(samples: list[dict], key: str) -> dict:
    values = sorted(s[key] for s in samples if s[key] is not None)
    return {"p50": statistics.median(values), "min": values[0], "max": values[-1]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kills", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("bench/results/http_cpu.json"))
    args = p.parse_args(argv)
    model, _ = ensure_demo_model()
    root = Path(tempfile.mkdtemp(prefix="kvh-"))
    server = ServeProcess(["--max-seq-len", "1024", "--log-level", "WARNING"], root, model=model,
                          instance=f"bench-http-{os.getpid()}", log_path=root / "serve.log")
    server.start(standbys=1, timeout=120)
    base = server.base
    try:
        with Client.for_instance(server.instance, root, timeout=60) as client:
            sdk_single(client, 3, 16)  # warm-up
            http_single(base, 3, 16)
            sdk = sdk_single(client, args.requests, args.max_tokens)
            http = http_single(base, args.requests, args.max_tokens)
            sdk_agg = sdk_concurrent(client, args.concurrency, args.max_tokens)
            http_agg = asyncio.run(_http_concurrent(base, args.concurrency, args.max_tokens))
        pauses = recovery_pauses(server, args.kills)
    finally:
        server.stop(60)
    result = {"machine": f"CPU, {os.cpu_count()} cores", "model": "demo (tiny)", "max_tokens": args.max_tokens,
              "single_stream": {"sdk": {k: _summary(sdk, k) for k in ("ttft_ms", "decode_tok_s")},
                                "http": {k: _summary(http, k) for k in ("ttft_ms", "decode_tok_s")}},
              "concurrent": {"streams": args.concurrency, "sdk_tok_s": sdk_agg, "http_tok_s": http_agg},
              "recovery_pause": {"kills": args.kills, **_summary(pauses, "pause_ms"),
                                 "median_gap_ms": statistics.median(p["median_gap_ms"] for p in pauses),
                                 "identical": sum(p["identical"] for p in pauses)},
              "raw": {"sdk": sdk, "http": http, "pauses": pauses}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
