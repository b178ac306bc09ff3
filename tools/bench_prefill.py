"""Benchmark: prefill tokens/s and model FLOPs utilisation, chunked as `kvhold serve` chunks it.

    python -m tools.bench_prefill --model DIR --device cuda:0 [--prompts 512,2048,8192]
        [--concurrent 1,8] [--max-batch 64 --max-batch-tokens 8192 --prefill-chunk N]
        [--variant LABEL:KEY=VALUE,...] [--peak-tflops 790] [--out FILE]

An engine outside any sidecar (tools.bench_engine_setup: the executor's engine, runner and
commit protocol over a private KV pool) takes K prompts of P random tokens at once, each
with max_tokens 1, and steps until every one has its first token: that time is the prefill
of K x P tokens, the commit of every page and token included. Prefill is chunked as a
served executor chunks it: --prefill-chunk, or what the executor derives from
--max-batch-tokens and --max-batch (kvhold.executor.engine_workload.cuda_prefill_chunk on
CUDA, the scheduler's default on CPU). Each (variant, P, K) is one row: the median of
--repeats timed runs after one untimed run, its tokens/s, its model FLOP/s and `mfu`, that
over --peak-tflops (the H200's bf16 dense peak by default; on CPU the figure means nothing).

Model FLOPs of a prompt of P tokens (the formula is written into the JSON too):
2 * P * N + 2 * L * H * D * P * (P + 1) + 2 * V * E, with N the decoder layers' projection
weights (q, k, v, o, gate, up, down), L layers, H query heads of D dims, V the vocabulary and
E the hidden size. Attention is counted causal, as the model needs it (QK^T and PV over the
keys at or before each position: 4 * H * D FLOPs per query-key pair and layer), not as the
padded chunk computes it; the LM head once, for the one sampled position; the embedding
lookup not at all.

Variants compare settings: `--variant LABEL:KEY=VALUE,...` runs the same rows with each KEY
set, an upper-case KEY as an environment variable (e.g. KVHOLD_FUSED=0), a lower-case one as
one of this tool's engine flags (prefill_chunk, max_batch_tokens, max_batch, commit). Each
variant runs in a process of its own (settings read at import or build time take effect);
with no --variant there is one, `served`, with the flags as given. Writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINE_KEYS = {"prefill_chunk": int, "max_batch_tokens": int, "max_batch": int, "commit": int,
               "exact_prefill": int}
H200_BF16_TFLOPS = 790.0
FLOPS_FORMULA = ("per prompt of P tokens: 2*P*N + 2*L*H*D*P*(P+1) + 2*V*E; N = the decoder layers' "
                 "projection weights (q,k,v,o,gate,up,down), L layers, H query heads of D dims, V the "
                 "vocabulary, E the hidden size; attention causal (4*H*D FLOPs per query-key pair and "
                 "layer over the keys at or before each position), the LM head once (the sampled "
                 "position), no embedding lookup")


def parse_variant(text: str) -> tuple[str, dict[str, str], dict[str, int]]:
    """'LABEL:KEY=VALUE,...' -> (label, environment, engine flags)."""
    label, _, rest = text.partition(":")
    if not label or not label.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"variant {text!r}: want LABEL:KEY=VALUE,... (LABEL of letters, "
                                         f"digits, - and _)")
    env, flags = {}, {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not KEY=VALUE")
        if key.isupper():
            env[key] = value
        elif key in ENGINE_KEYS:
            try:
                flags[key] = ENGINE_KEYS[key](value)
            except ValueError:
                raise argparse.ArgumentTypeError(f"variant {text!r}: {key} wants an integer") from None
        else:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {key!r} is neither an environment variable "
                                             f"(upper case) nor one of {', '.join(ENGINE_KEYS)}")
    return label, env, flags


def int_list(text: str) -> str:
    """A comma-separated list of positive integers (kept as text: the children get it as given)."""
    try:
        ok = all(int(x) > 0 for x in text.split(",") if x)
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"want positive integers separated by commas, got {text!r}")
    return text


def layer_params(spec) -> int:
    """N: the decoder layers' projection weights (q, k, v, o, gate, up, down)."""
    return spec.num_layers * (spec.hidden_size * (2 * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
                              + 3 * spec.hidden_size * spec.intermediate_size)


def model_flops(spec, prompt: int) -> float:
    """FLOPS_FORMULA for one prompt of `prompt` tokens."""
    attention = 2 * spec.num_layers * spec.num_heads * spec.head_dim * prompt * (prompt + 1)
    return 2 * prompt * layer_params(spec) + attention + 2 * spec.vocab_size * spec.hidden_size


def served_chunk(device: str, prefill_chunk: int | None, max_batch_tokens: int, max_batch: int,
                 exact: bool = True) -> int:
    from kvhold.executor.engine_workload import cuda_prefill_chunk

    if device.startswith("cuda"):
        return cuda_prefill_chunk(prefill_chunk, max_batch_tokens, max_batch, exact)
    return prefill_chunk or max(1, max_batch_tokens - max_batch)       # kvhold.executor.scheduler


def reference_gemm(torch, device: str, rows: int, spec) -> dict:
    """What the device's bf16 GEMM (cuBLAS, through torch) reaches at one chunk's widest
    projection, [rows, hidden] x [hidden, intermediate]: a ceiling for the MFU of the layers."""
    a = torch.randn((rows, spec.hidden_size), device=device, dtype=torch.bfloat16)
    b = torch.randn((spec.hidden_size, spec.intermediate_size), device=device, dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    torch.cuda.synchronize()
    n, t = 50, time.perf_counter()
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / n
    return {"shape": [rows, spec.hidden_size, spec.intermediate_size], "ms": round(dt * 1e3, 4),
            "tflops_per_s": round(2 * rows * spec.hidden_size * spec.intermediate_size / dt / 1e12, 1)}


ATTENTION_KERNELS = ("fmha", "attention", "flash")                  # matched first: cutlass names both
GEMM_KERNELS = ("gemm", "cutlass", "sm90", "nvjet", "matmul", "skinny")


def profile_run(torch, run, prompt: int, top: int = 20) -> dict:
    """One prefill of `prompt` tokens under torch.profiler: device time per kernel, the `top`
    largest, the shares of attention and GEMM kernels in it, and how busy the device was
    (its kernels' time over the wall time, which the profiler lengthens a little)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None)
        us = e.cuda_time_total if us is None else us
        if us > 0:
            kernels.append((e.key, us / 1e3, e.count))
    kernels.sort(key=lambda k: -k[1])
    total = sum(k[1] for k in kernels)
    attention = sum(ms for name, ms, _ in kernels if any(w in name.lower() for w in ATTENTION_KERNELS))
    gemm = sum(ms for name, ms, _ in kernels if not any(w in name.lower() for w in ATTENTION_KERNELS)
               and any(w in name.lower() for w in GEMM_KERNELS))
    return {"prompt_tokens": prompt, "wall_s": round(result["wall_s"], 5), "device_ms": round(total, 3),
            "device_busy_share": round(total / 1e3 / result["wall_s"], 4),
            "attention_share": round(attention / total, 4) if total else None,
            "gemm_share": round(gemm / total, 4) if total else None,
            "kernels": [{"name": n[:160], "ms": round(ms, 3), "calls": c} for n, ms, c in kernels[:top]]}


def run_variant(args, label: str, flags: dict, save=lambda out: None) -> dict:
    """Every (prompt, concurrency) row of one variant, in this process; `save(out)` after each row."""
    import torch

    from kvhold.protocol.journal import Journal
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import admit, build_engine, load_weights

    cfg = {k: flags.get(k, getattr(args, k)) for k in ENGINE_KEYS}
    prompts = [int(x) for x in args.prompts.split(",")]
    concurrent = [int(x) for x in args.concurrent.split(",")]
    profile_prompts = [int(x) for x in args.profile_prompt.split(",") if x]
    spec = ModelSpec.from_dir(args.model)
    chunk = served_chunk(args.device, cfg["prefill_chunk"], cfg["max_batch_tokens"], cfg["max_batch"],
                         bool(cfg["exact_prefill"]))
    pt = 16
    max_seq = -(-(max(prompts + profile_prompts) + 1 + chunk) // pt) * pt
    kv_pages = args.kv_pages or (max(concurrent) * (max_seq // pt) + 64)
    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_load = time.monotonic()
    weights = load_weights(args.model, args.device)
    t_built = time.monotonic()
    engine, tables = build_engine(args.model, args.device, kv_pages, max_seq, cfg["max_batch"],
                                  cfg["max_batch_tokens"], chunk, commit=bool(cfg["commit"]), weights=weights,
                                  exact_prefill=bool(cfg["exact_prefill"]))
    setup = {"load_s": round(t_built - t_load, 2), "engine_s": round(time.monotonic() - t_built, 2)}
    journal = Journal(tables)
    gen = torch.Generator().manual_seed(0)
    rows = []
    out = {"variant": label, "engine_flags": cfg, "environment": {k: v for k, v in os.environ.items()
                                                                  if k.startswith("KVHOLD_")},
           "setup": setup, "complete": False, "rows": rows, "profiles": []}
    if cuda:
        out["device"] = torch.cuda.get_device_name(args.device)
        out["reference_gemm"] = reference_gemm(torch, args.device, chunk, spec)

    def one_run(prompt: int, k: int) -> dict:
        slots: list[int] = []
        ids = [torch.randint(3, spec.vocab_size, (prompt,), generator=gen).tolist() for _ in range(k)]
        sync()
        t0 = time.perf_counter()
        rids = admit(tables, [dict(prompt_ids=p, max_tokens=1) for p in ids], slots)
        first: dict[int, float] = {}
        steps = 0
        while len(first) < k:
            changed = engine.step()
            steps += 1
            for slot, rid in zip(slots, rids):
                if slot not in first and journal.progress(slot, rid)[1] >= 1:
                    first[slot] = time.perf_counter()
            if steps > 10 * k * (prompt // chunk + 2):
                raise RuntimeError(f"no first token after {steps} steps (changed {changed})")
        sync()
        wall = time.perf_counter() - t0
        for slot in slots:
            journal.release(slot)
        return {"wall_s": wall, "steps": steps,
                "first_token_s": sorted(round(t - t0, 5) for t in first.values())}

    try:
        for prompt in prompts:
            for k in concurrent:
                one_run(prompt, k)                                # untimed: first use of each shape
                runs = [one_run(prompt, k) for _ in range(args.repeats)]
                wall = statistics.median(r["wall_s"] for r in runs)
                flops = k * model_flops(spec, prompt)
                row = {"variant": label, "prompt_tokens": prompt, "concurrent": k, "prefill_chunk": chunk,
                       "max_batch_tokens": cfg["max_batch_tokens"], "max_batch": cfg["max_batch"],
                       "commit": bool(cfg["commit"]), "chunks_per_prompt": -(-prompt // chunk),
                       "wall_s": round(wall, 5), "tokens_per_s": round(k * prompt / wall, 1),
                       "model_flops": flops, "model_tflops_per_s": float(f"{flops / wall / 1e12:.4g}"),
                       "mfu": float(f"{flops / wall / (args.peak_tflops * 1e12):.4g}"),
                       "steps": runs[0]["steps"], "step_ms": round(wall / runs[0]["steps"] * 1e3, 3),
                       "runs_wall_s": [round(r["wall_s"], 5) for r in runs],
                       "first_token_s": runs[len(runs) // 2]["first_token_s"]}
                rows.append(row)
                if cuda:
                    out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(args.device) / 2**30, 2)
                save(out)
                print(f"{label}: prompt {prompt:5d} x{k:2d}: {row['wall_s'] * 1e3:9.1f} ms, "
                      f"{row['tokens_per_s']:9.0f} tok/s, {row['model_tflops_per_s']:7.1f} TFLOP/s, "
                      f"mfu {row['mfu']:.3f} ({row['steps']} steps, chunk {chunk})", flush=True)
        for prompt in profile_prompts:
            try:
                out["profiles"].append(profile_run(torch, lambda: one_run(prompt, 1), prompt))
            except Exception as exc:      # the rows stand without it; say why it is missing
                out["profiles"].append({"prompt_tokens": prompt, "error": f"{type(exc).__name__}: {exc}"})
            save(out)
    finally:
        tables.unlink()
    out["complete"] = True
    save(out)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--prompts", type=int_list, default="512,2048,8192", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--concurrent", type=int_list, default="1", help="prompts admitted at once, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (after one untimed)")
    p.add_argument("--max-batch", type=int, default=64, help="as kvhold serve's flag (default 64)")
    p.add_argument("--max-batch-tokens", type=int, default=8192,
                   help="as kvhold serve's flag (default 8192, tools/h200_run.sh's LOAD)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="as kvhold serve's flag (default: what the executor derives)")
    p.add_argument("--commit", type=int, default=1, choices=(0, 1),
                   help="1: the full commit protocol, as served; 0: NoCommit (the engine only)")
    p.add_argument("--exact-prefill", type=int, default=1, choices=(0, 1),
                   help="1: exact prefill (prefill rows on the decode kernels: the executors' default); "
                        "0: cuBLAS and SDPA (the executors' --no-exact-prefill)")
    p.add_argument("--kv-pages", type=int, default=None, help="KV pool pages (default: what the rows need)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_TFLOPS,
                   help=f"the device's peak, the MFU's denominator (default {H200_BF16_TFLOPS}: H200 bf16)")
    p.add_argument("--profile-prompt", type=int_list, default="", metavar="TOKENS,...",
                   help="after the rows, profile one prefill of each of these lengths (CUDA): time per kernel")
    p.add_argument("--variant", action="append", type=parse_variant, default=[],
                   help="LABEL:KEY=VALUE,... (repeatable): see the module docstring")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("bench/results/prefill_cuda.json"))
    args = p.parse_args(argv)
    if args.profile_prompt and not args.device.startswith("cuda"):
        p.error("--profile-prompt profiles CUDA kernels: it needs a CUDA --device")
    if args.child:
        label, flags = json.loads(args.child)
        run_variant(args, label, flags, save=lambda out: args.out.write_text(json.dumps(out) + "\n"))
        return 0
    variants = args.variant or [("served", {}, {})]
    if len({v[0] for v in variants}) != len(variants):
        p.error("variant labels must differ")
    from kvhold.protocol.model_spec import ModelSpec
    spec = ModelSpec.from_dir(args.model)
    base = [a for i, a in enumerate(argv) if a != "--variant" and (i == 0 or argv[i - 1] != "--variant")
            and not a.startswith("--variant=")]
    signal.signal(signal.SIGTERM, _stop)      # `timeout` ran out: write what has been measured
    results, tmpdir = [], Path(tempfile.mkdtemp(prefix="kvhold-prefill-"))
    try:
        for label, env, flags in variants:
            part = tmpdir / f"{label}.json"
            cmd = [sys.executable, "-m", "tools.bench_prefill", *base, "--child", json.dumps([label, flags]),
                   "--out", str(part)]
            try:
                rc = subprocess.run(cmd, env={**os.environ, **env}).returncode
            except BaseException:
                rc = "stopped"
                raise
            finally:
                got = json.loads(part.read_text()) if part.is_file() and part.stat().st_size else {
                    "variant": label, "engine_flags": flags, "rows": []}
                got["environment_set"] = env
                if rc:
                    got["error"] = f"exited with {rc}" if rc != "stopped" else "stopped (SIGTERM)"
                results.append(got)
    finally:
        rows = [r for v in results for r in v["rows"]]
        result = {"command": "python -m tools.bench_prefill " + " ".join(argv),
                  "machine": next((v["device"] for v in results if "device" in v), f"CPU, {os.cpu_count()} cores"),
                  "model": str(args.model), "peak_tflops": args.peak_tflops, "flops_formula": FLOPS_FORMULA,
                  "layer_params": layer_params(spec), "vocab_size": spec.vocab_size,
                  "hidden_size": spec.hidden_size, "complete": len(results) == len(variants) and all(
                      v.get("complete") and "error" not in v for v in results),
                  "rows": rows, "variants": [{k: v for k, v in r.items() if k != "rows"} for r in results]}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        shutil.rmtree(tmpdir, ignore_errors=True)
        print(f"wrote {args.out}: {len(rows)} rows")
    return 0 if result["complete"] else 1


def _stop(signum, frame):
    raise SystemExit(128 + signum)

if __name__ == "__main__":
    sys.exit(main())
