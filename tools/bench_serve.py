"""Benchmark: `kvhold serve` under streaming HTTP load, and a kill of its active executor mid-run.

    python -m tools.bench_serve --model DIR --device cuda:0 [--concurrency 1,8,32,64]
        [--rounds 2] [--prompt-len 512 | 128,512] [--max-tokens 128 | 128,384] [--kill-concurrency 32]
        [--serve-args "--kv-memory 24GiB --max-batch-tokens 8192"] [--out FILE]

Starts `kvhold serve` (real processes: supervisor, sidecar, active and standby executors,
HTTP server) and drives streaming /v1/completions from one asyncio process (httpx): for each
concurrency C, C clients each send --rounds requests back to back (prompts of --prompt-len
random token ids, greedy, --max-tokens with ignore_eos, usage in the last chunk; a MIN,MAX
length is drawn uniformly per request, as ShareGPT-like loads are: --prompt-len 128,512
--max-tokens 128,384). Per
request: time to first token (TTFT: send -> first content chunk), the gaps between content
chunks (ITL), end to end (E2E), content chunks against completion tokens; per level: their
percentiles, output tokens/s (completion tokens over the level's wall time) and errors.
Then the kill run: the same requests as the C = --kill-concurrency level, and once every
stream has its first chunk and the streams are on average a third through, a SIGKILL of the
active executor (its pid from /health); reports the longest gap between two chunks any client
saw, each stream's longest gap, errors, and whether each output equals the uninterrupted one.
On CUDA it also writes what the hardware allows for the workload (`floor`): each level's
prefill at the GPU's bf16 peak plus its decode steps at the bandwidth floor (the weights and
the KV each step reads), as output tokens/s, with the peak and bandwidth it assumed
(--peak-tflops, --bandwidth-tbs: the H200's by default).
Writes JSON (and a PNG of the gaps if matplotlib is available).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvhold.testing.serve_process import ServeProcess


class Server(ServeProcess):
    """One `kvhold serve` with its own instance and runtime root, in a session of its own; ready
    on return (`ready_s` after its start); stopped with SIGTERM, its root then removed."""

    def __init__(self, model: Path, device: str, max_seq_len: int, extra: list[str], log_path: Path,
                 standbys: int = 1, start_timeout: float = 900.0):
        root = Path(tempfile.mkdtemp(prefix="kvh-bs-", dir="/tmp"))
        os.chmod(root, 0o700)
        flags = ["--device", device, "--max-seq-len", str(max_seq_len), "--standbys", str(standbys),
                 "--no-access-log"]
        if device.startswith("cuda"):
            flags += ["--backend", "cuda", "--startup-lease-ms", "600000"]
        super().__init__([*flags, *extra], root, model=model, log_path=log_path, new_session=True)
        self.root = root
        self.started = time.monotonic()
        try:
            self.start(standbys, start_timeout)
        except BaseException:
            sys.stderr.write(f"kvhold serve did not start; the end of {log_path}:\n"
                             + log_path.read_bytes()[-4000:].decode(errors="replace"))
            raise
        self.ready_s = time.monotonic() - self.started

    def last_recovery(self) -> dict | None:
        """The sidecar's record of its last recovery (`kvhold status --json`'s `recoveries`)."""
        records = self.sidecar_status(timeout=10).get("recoveries") or []
        return records[-1] if records else None

    def stop(self, timeout: float = 60.0) -> int | None:
        code = super().stop(timeout)
        shutil.rmtree(self.root, ignore_errors=True)
        return code


def percentiles(values: list[float]) -> dict | None:
    if not values:
        return None
    v = sorted(values)

    def q(p):
        return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
    return {"n": len(v), "mean": round(statistics.fmean(v), 3), "p50": round(q(50), 3), "p90": round(q(90), 3),
            "p99": round(q(99), 3), "max": round(v[-1], 3)}


async def stream_one(client: httpx.AsyncClient, body: dict, on_chunk=None) -> dict:
    """One streamed completion: send time, each content chunk's arrival, text, usage, error."""
    out = {"chunks": [], "text": "", "completion_tokens": None, "error": None}
    pieces = []
    t0 = time.perf_counter()
    out["t0"] = t0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    out["completion_tokens"] = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        out["chunks"].append(time.perf_counter())
                        pieces.append(choice["text"])
                        if on_chunk is not None:
                            on_chunk()
                    if choice.get("finish_reason"):
                        out["finish_reason"] = choice["finish_reason"]
    except (httpx.HTTPError, ValueError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["text"] = "".join(pieces)
    return out


def length_range(text: str) -> tuple[int, int]:
    """`N` or `MIN,MAX` (inclusive; drawn uniformly per request) -> (MIN, MAX)."""
    try:
        lo, hi = (int(x) for x in text.split(",")) if "," in text else (int(text),) * 2
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a length or MIN,MAX range: {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"a length range needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


def request_bodies(n: int, prompt_len, max_tokens, vocab: int, seed: int, model: str) -> list[dict]:
    """`n` greedy streamed completions of random token ids; `prompt_len` and `max_tokens` are a
    length or a (MIN, MAX) range, drawn uniformly per request."""
    rng = random.Random(seed)
    plo, phi = (prompt_len, prompt_len) if isinstance(prompt_len, int) else prompt_len
    tlo, thi = (max_tokens, max_tokens) if isinstance(max_tokens, int) else max_tokens
    bodies = []
    for _ in range(n):
        length = rng.randint(plo, phi)
        bodies.append({"model": model, "prompt": [rng.randrange(3, vocab) for _ in range(length)],
                       "max_tokens": rng.randint(tlo, thi), "temperature": 0.0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}})
    return bodies


def workload_floor(bodies: list[dict], concurrency: int, weight_bytes: int, kv_bytes_per_token: int,
                   params: int, peak_flops: float, bandwidth: float) -> dict:
    """What the hardware allows for `bodies` served `concurrency` at a time: every prompt token's
    prefill at `peak_flops` (2 x params FLOPs a token; attention left out) plus decode steps of
    `concurrency` rows, each reading the weights and the KV of its rows once at `bandwidth`
    (a row's context taken at its request's mean: prompt + half its output). Output tokens/s =
    the output tokens over that time. A lower bound on time, not a schedule: it overlaps nothing
    and ignores the steps' compute, launches and the host."""
    prompt = sum(len(b["prompt"]) for b in bodies)
    output = sum(b["max_tokens"] for b in bodies)
    prefill_s = 2 * params * prompt / peak_flops
    mean_context = sum((len(b["prompt"]) + b["max_tokens"] / 2) * b["max_tokens"] for b in bodies) / output
    steps = output / concurrency
    step_s = (weight_bytes + concurrency * mean_context * kv_bytes_per_token) / bandwidth
    decode_s = steps * step_s
    return {"prompt_tokens": prompt, "output_tokens": output, "prefill_s": round(prefill_s, 4),
            "decode_step_ms": round(step_s * 1e3, 3), "decode_s": round(decode_s, 4),
            "output_tokens_per_s": round(output / (prefill_s + decode_s), 1)}


def model_sizes(model: Path) -> tuple[int, int, int]:
    """(weight bytes, parameters, KV bytes a token) of a checkpoint, from its safetensors
    headers and config.json (the KV in the checkpoint's dtype)."""
    from safetensors import safe_open

    cfg = json.loads((model / "config.json").read_text())
    weight_bytes = params = 0
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                params += n
                weight_bytes += n * {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F64": 8}.get(t.get_dtype(), 2)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"float32": 4, "float64": 8}.get(cfg.get("torch_dtype"), 2)
    kv = cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim * 2 * dtype_bytes
    return weight_bytes, params, kv


async def run_level(base: str, bodies: list[dict], concurrency: int, kill=None) -> tuple[list[dict], float]:
    """`concurrency` clients share `bodies` in order, each sending its next one when the last ends.
    `kill(results_so_far)` is polled while they run (the kill run)."""
    results: list[dict | None] = [None] * len(bodies)
    live: list[dict] = []
    queue = list(enumerate(bodies))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        async def worker():
            while queue:
                i, body = queue.pop(0)
                state = {"chunks": 0}
                live.append(state)
                res = await stream_one(client, body, on_chunk=lambda: state.__setitem__("chunks", state["chunks"] + 1))
                results[i] = res
        t0 = time.perf_counter()
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        if kill is not None:
            killer = asyncio.create_task(kill(live))
        await asyncio.gather(*workers)
        wall = time.perf_counter() - t0
        if kill is not None and not killer.done():
            killer.cancel()                 # the streams ended before its mark: no kill
    return results, wall


def summarise(results: list[dict], wall: float, max_tokens) -> dict:
    """A level's figures; `max_tokens`: every request's, or a list of each one's."""
    ttft, itl, e2e, tpot = [], [], [], []
    chunks = tokens = 0
    errors = [r["error"] for r in results if r["error"]]
    short = 0
    wanted = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(results)
    for r, want in zip(results, wanted):
        c = r["chunks"]
        chunks += len(c)
        tokens += r["completion_tokens"] or 0
        if r["completion_tokens"] != want:
            short += 1
        if not c:
            continue
        ttft.append((c[0] - r["t0"]) * 1e3)
        e2e.append((c[-1] - r["t0"]) * 1e3)
        gaps = [(b - a) * 1e3 for a, b in zip(c, c[1:])]
        itl += gaps
        if len(c) > 1:
            tpot.append((c[-1] - c[0]) * 1e3 / (len(c) - 1))
    return {"requests": len(results), "errors": len(errors), "error_samples": errors[:5],
            "not_max_tokens": short, "wall_s": round(wall, 3),
            "output_tokens_per_s": round(tokens / wall, 1), "requests_per_s": round(len(results) / wall, 3),
            "completion_tokens": tokens, "content_chunks": chunks,
            "chunks_per_token": round(chunks / tokens, 4) if tokens else None,
            "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl), "tpot_ms": percentiles(tpot),
            "e2e_ms": percentiles(e2e)}


def kill_summary(results: list[dict], kill_at: float | None, reference: list[dict] | None) -> dict:
    """What the clients saw of the kill: the longest gap between two chunks of any stream, the
    gap that holds the kill (last chunk before it -> first after it) and the kill -> next chunk
    per stream, the longest gap that does not hold it, and each stream's chunk times from the kill."""
    out = {"killed": kill_at is not None}
    if kill_at is None:
        return out
    longest, per_stream, spanning, to_next, elsewhere = 0.0, [], [], [], 0.0
    for r in results:
        c = r["chunks"]
        gaps = [(b - a) * 1e3 for a, b in zip(c, c[1:])]
        if gaps:
            per_stream.append(max(gaps))
            longest = max(longest, max(gaps))
        elsewhere = max([elsewhere] + [(b - a) * 1e3 for a, b in zip(c, c[1:]) if not a <= kill_at < b])
        before = [t for t in c if t <= kill_at]
        after = [t for t in c if t > kill_at]
        if before and after:
            spanning.append((after[0] - before[-1]) * 1e3)
        if after:
            to_next.append((after[0] - kill_at) * 1e3)
    out.update(longest_gap_ms=round(longest, 3), stream_longest_gap_ms=percentiles(per_stream),
               gap_across_kill_ms=percentiles(spanning), kill_to_next_chunk_ms=percentiles(to_next),
               longest_gap_not_across_kill_ms=round(elsewhere, 3), streams_across_kill=len(spanning),
               chunk_ms_from_kill=[[round((t - kill_at) * 1e3, 1) for t in r["chunks"]] for r in results])
    if reference is not None:
        out["identical_to_uninterrupted"] = sum(1 for r, ref in zip(results, reference)
                                                if not r["error"] and r["text"] == ref["text"])
        out["compared"] = len(results)
    return out


def plot(path: Path, levels: list[dict], kill_results: list[dict] | None, kill_at: float | None) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    cs = [lv["concurrency"] for lv in levels]
    for key, label in (("ttft_ms", "TTFT p50"), ("itl_ms", "ITL p50")):
        axes[0].plot(cs, [(lv[key] or {}).get("p50") for lv in levels], "o-", label=label)
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("concurrent streams")
    axes[0].set_ylabel("ms")
    axes[0].legend()
    if kill_results and kill_at is not None:
        for r in kill_results:
            c = r["chunks"]
            axes[1].plot([t - kill_at for t in c[1:]], [(b - a) * 1e3 for a, b in zip(c, c[1:])], ".", ms=2)
        axes[1].axvline(0, color="k", lw=0.5)
        axes[1].set_xlabel("s from the SIGKILL")
        axes[1].set_ylabel("gap before the chunk, ms")
        axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint (default: the tiny demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", default="1,8,32,64", help="concurrent streams per level, comma-separated")
    p.add_argument("--rounds", type=int, default=2, help="requests per client per level")
    p.add_argument("--prompt-len", type=length_range, default=(512, 512),
                   help="prompt token ids per request: N, or MIN,MAX drawn uniformly per request (default 512)")
    p.add_argument("--max-tokens", type=length_range, default=(128, 128),
                   help="output tokens per request (ignore_eos): N, or MIN,MAX drawn uniformly (default 128)")
    p.add_argument("--peak-tflops", type=float, default=989.4,
                   help="the GPU's dense bf16 peak for the floor (default: the H200's, 989.4)")
    p.add_argument("--bandwidth-tbs", type=float, default=4.8,
                   help="the GPU's memory bandwidth for the floor, TB/s (default: the H200's, 4.8)")
    p.add_argument("--max-seq-len", type=int, default=None, help="default: prompt + max tokens, to a page")
    p.add_argument("--kill-concurrency", type=int, default=32, help="streams in the kill run (0: no kill run)")
    p.add_argument("--kill-fraction", type=float, default=1 / 3,
                   help="kill once the streams have on average this share of their tokens")
    p.add_argument("--serve-args", default="", help="more `kvhold serve` flags, one shell-quoted string")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/serve_cuda.json"))
    args = p.parse_args(argv)
    levels_c = [int(x) for x in args.concurrency.split(",") if x]
    if any(c < 1 for c in levels_c) or args.rounds < 1 or args.kill_concurrency < 0:
        p.error("concurrency levels and rounds must be positive")
    if args.model is None:
        from kvhold.testing.make_model import ensure_demo_model
        args.model, _ = ensure_demo_model()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    max_seq = args.max_seq_len or -(-(args.prompt_len[1] + args.max_tokens[1] + 1) // 16) * 16
    mean_tokens = sum(args.max_tokens) / 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_path = args.out.with_suffix(".serve.log")
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, _stop)      # `timeout` ran out: stop the server, keep what was measured
    server = Server(args.model, args.device, max_seq, shlex.split(args.serve_args), log_path,
                    start_timeout=args.start_timeout)
    print(f"kvhold serve ready in {server.ready_s:.1f} s: {' '.join(server.cmd)}", flush=True)
    name = httpx.get(server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
    levels, raw = [], {}
    machine = f"{os.cpu_count()} CPU cores"
    if args.device.startswith("cuda"):
        try:
            import torch
            machine = f"{torch.cuda.get_device_name(args.device)}, {machine}"
        except Exception as exc:          # the device name is a label; the figures stand without it
            machine += f" (device name unknown: {exc})"
    result = {"command": "python -m tools.bench_serve " + " ".join(shlex.quote(a) for a in argv),
              "serve_command": server.cmd, "machine": machine, "model": str(args.model), "device": args.device,
              "prompt_len": _length(args.prompt_len), "max_tokens": _length(args.max_tokens), "rounds": args.rounds,
              "ready_s": round(server.ready_s, 1), "complete": False, "levels": levels, "kill": None,
              "notes": "ITL: gaps between consecutive content chunks of one stream; TTFT: request sent -> "
                       "first content chunk; E2E: sent -> last content chunk; output tokens/s: completion "
                       "tokens (usage) over the level's wall time",
              "raw_per_request": {}}

    def save():
        result["total_s"] = round(time.monotonic() - t_start, 1)
        result["raw_per_request"] = {str(c): [{"ttft_ms": round((r["chunks"][0] - r["t0"]) * 1e3, 3)
                                               if r["chunks"] else None, "chunks": len(r["chunks"]),
                                               "completion_tokens": r["completion_tokens"], "error": r["error"]}
                                              for r in rs] for c, rs in raw.items()}
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    kill_results = kill_at = None
    try:
        warm = request_bodies(2, args.prompt_len, min(8, args.max_tokens[0]), vocab, args.seed + 999, name)
        asyncio.run(run_level(server.base, warm, 2))
        sizes = model_sizes(args.model) if args.device.startswith("cuda") else None
        if sizes is not None:
            result["floor_assumes"] = {"peak_tflops": args.peak_tflops, "bandwidth_tbs": args.bandwidth_tbs,
                                       "weight_bytes": sizes[0], "parameters": sizes[1], "kv_bytes_per_token": sizes[2]}
        for c in levels_c:
            bodies = request_bodies(c * args.rounds, args.prompt_len, args.max_tokens, vocab, args.seed + c, name)
            results, wall = asyncio.run(run_level(server.base, bodies, c))
            level = {"concurrency": c, **summarise(results, wall, [b["max_tokens"] for b in bodies])}
            if sizes is not None:
                level["floor"] = workload_floor(bodies, c, sizes[0], sizes[2], sizes[1], args.peak_tflops * 1e12,
                                                args.bandwidth_tbs * 1e12)
            levels.append(level)
            raw[c] = results
            save()
            print(f"C={c:3d}: {level['output_tokens_per_s']:8.1f} tok/s, TTFT p50 "
                  f"{(level['ttft_ms'] or {}).get('p50')} ms, ITL p50 {(level['itl_ms'] or {}).get('p50')} ms, "
                  f"errors {level['errors']}, chunks/token {level['chunks_per_token']}", flush=True)
        if args.kill_concurrency:
            c = args.kill_concurrency
            server.wait_healthy(1, 300)            # a standby ready before the kill
            victim = server.get_health()["active_pid"]
            bodies = request_bodies(c * args.rounds, args.prompt_len, args.max_tokens, vocab, args.seed + c, name)
            marks = {}

            async def killer(live):
                # every stream of the first wave has its first chunk and, on average, the fraction
                while True:
                    await asyncio.sleep(0.002)
                    wave = live[:c]
                    if len(wave) == c and all(s["chunks"] > 0 for s in wave) and \
                            statistics.fmean(s["chunks"] for s in wave) >= args.kill_fraction * mean_tokens:
                        break
                    if len(live) > c:           # the first wave ended before the mark: kill now
                        break
                marks["kill"] = time.perf_counter()
                os.kill(victim, signal.SIGKILL)
            kill_results, wall = asyncio.run(run_level(server.base, bodies, c, kill=killer))
            kill_at = marks.get("kill")
            kill = {"concurrency": c, "victim_pid": victim,
                    **summarise(kill_results, wall, [b["max_tokens"] for b in bodies]),
                    **kill_summary(kill_results, kill_at, raw.get(c))}
            t0 = min(r["t0"] for r in kill_results)
            kill["kill_s_after_start"] = round(kill_at - t0, 3) if kill_at else None
            kill["active_pid_after"] = (server.get_health() or {}).get("active_pid")
            kill["recovery_record"] = server.last_recovery()
            result["kill"] = kill
            save()
            print(f"kill at C={c}: longest gap {kill.get('longest_gap_ms')} ms, errors {kill['errors']}, "
                  f"identical {kill.get('identical_to_uninterrupted')}/{kill.get('compared')}", flush=True)
        result["complete"] = True
    finally:
        result["serve_exit_code"] = server.stop()
        if plot(args.out.with_suffix(".png"), levels, kill_results, kill_at):
            result["plot"] = args.out.with_suffix(".png").name
        save()
        print(f"wrote {args.out}")
    return 0


def _length(lo_hi: tuple[int, int]):
    """A length as the JSON keeps it: N, or [MIN, MAX]."""
    return lo_hi[0] if lo_hi[0] == lo_hi[1] else list(lo_hi)


def _stop(signum, frame):
    raise SystemExit(128 + signum)

if __name__ == "__main__":
    sys.exit(main())
