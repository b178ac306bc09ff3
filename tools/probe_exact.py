"""Exact prefill on the GPU: is a GEMM row's result independent of the tiles, and what does exactness cost?

    python -m tools.probe_exact --gemm [--budget-s 120] --out bench/results/exact_gemm_cuda.json
    python -m tools.probe_exact --prefill --model DIR [--prompts 512,2048,8192] [--chunks 512,2048]
                                --out bench/results/exact_prefill_cuda.json

--gemm: kvhold.executor.cuda.gemm's kernel over [M, K] @ [N, K].T at Llama-3-8B's shapes
(q|k|v, o, gate|up, down), M = 2048. Reference: each block of 64 rows as a decode step
computes it (the decode's tiles). Every other configuration (BLOCK_M 16..256, BLOCK_N,
BLOCK_K, warps, stages, the grouped program order) is compared to it bit for bit
(`identical`, and how many elements differ), and timed (TFLOP/s), next to cuBLAS
(F.linear / addmm_) at the same shape. Stops starting new configurations after
--budget-s seconds.

--prefill: one sequence's prefill on CudaRunner, exact prefill on (attention one row per
program, or packed: several positions per program) and off: prompt tokens/s
and MFU (model FLOPs, 2 per weight per token plus causal attention, against
--peak-tflops), per prompt length and chunk size; the decode step time per bucket
(graph replay; decode is the same in both modes); and, exact on, whether the KV pages
and last logits of a single prefill, a chunked one (random chunk sizes) and decode steps
are the same bits (the 8B model's shapes, every layer).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, True), "gate_up": (28672, 4096, False),
          "down": (4096, 14336, True)}


def _bits(t):
    return t.contiguous().view(torch.int16)


def _time(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def gemm(args) -> dict:
    from kvhold.executor.cuda import gemm as cuda_gemm

    t0 = time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = args.rows
    rows = []
    configs = []
    for bm in (16, 32, 64, 128, 256):
        for bn in (32, 64, 128, 256):
            for bk in (32, 64, 128, 256):
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        tile_bytes = (bm + bn) * bk * 2 * stages
                        if tile_bytes > 220 * 1024 or bm * bn > 128 * 256 or (bm >= 128 and warps == 4 and bn >= 128):
                            continue
                        configs.append((bm, bn, bk, warps, stages))
    # the most telling first: big tiles (throughput) and the decode's BLOCK_K at every BLOCK_M
    rng = random.Random(0)
    big = [c for c in configs if c[0] >= 128 and c[1] >= 128 and c[2] in (64, 128)]
    rest = [c for c in configs if c not in big]
    rng.shuffle(rest)
    for name, (n, k, residual) in SHAPES.items():
        x = torch.randn((m, k), generator=gen, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        h = torch.randn((m, n), generator=gen, device="cuda", dtype=torch.bfloat16)
        flops = 2 * m * n * k
        ref = []
        for i in range(0, m, 64):
            r = h[i:i + 64].clone() if residual else None
            ref.append(cuda_gemm.skinny(x[i:i + 64], w, residual=r, out=r))
        ref = torch.cat(ref)
        dec = cuda_gemm.tiles(n, k, 64)
        r16 = h[:16].clone() if residual else None
        one = cuda_gemm.skinny(x[:16], w, residual=r16, out=r16)
        rows.append({"shape": name, "n": n, "k": k, "impl": "decode_tiles_16_rows", "config": list(dec),
                     "identical": bool(torch.equal(_bits(one), _bits(ref[:16])))})
        hb = h.clone()
        if residual:
            t = _time(lambda: hb.addmm_(x, w.t()))
            want = h.float() + F.linear(x, w).float()
        else:
            t = _time(lambda: F.linear(x, w))
            want = F.linear(x, w).float()
        cub = (h.clone().addmm_(x, w.t()) if residual else F.linear(x, w))
        rows.append({"shape": name, "n": n, "k": k, "impl": "cublas", "tflops": round(flops / t / 1e12, 1),
                     "identical": bool(torch.equal(_bits(cub), _bits(ref))),
                     "differing": int((_bits(cub) != _bits(ref)).sum())})
        print(json.dumps(rows[-1]), flush=True)
        exact = cuda_gemm.prefill_tiles(n, k)
        per_shape = [(exact[0], exact[1], exact[2], exact[3], exact[4])] + big + rest
        for bm, bn, bk, warps, stages in per_shape:
            if time.monotonic() - t0 > args.budget_s * (list(SHAPES).index(name) + 1) / len(SHAPES):
                break
            if k % bk:
                continue
            for group in ((8,) if bm >= 64 else (0,)):
                out = h.clone() if residual else None
                try:
                    def run():
                        return cuda_gemm.skinny(x, w, residual=out, out=out, block_n=bn, block_k=bk,
                                                num_warps=warps, num_stages=stages, rows_per_program=bm,
                                                group_m=group)
                    if residual:
                        got = cuda_gemm.skinny(x, w, residual=h.clone(), out=None, block_n=bn, block_k=bk,
                                               num_warps=warps, num_stages=stages, rows_per_program=bm,
                                               group_m=group)
                    else:
                        got = run()
                    t = _time(run, reps=5)
                except Exception as exc:    # out of shared memory / registers: say so, go on
                    rows.append({"shape": name, "impl": "skinny", "config": [bm, bn, bk, warps, stages, group],
                                 "error": type(exc).__name__ + ": " + str(exc)[:120]})
                    continue
                diff = int((_bits(got) != _bits(ref)).sum())
                row = {"shape": name, "n": n, "k": k, "impl": "skinny", "config": [bm, bn, bk, warps, stages, group],
                       "decode_block_k": dec[1], "tflops": round(flops / t / 1e12, 1), "identical": diff == 0,
                       "differing": diff, "max_err_vs_cublas_fp32": round(float((got.float() - want).abs().max()), 4),
                       "chosen_for_exact_prefill": (bm, bn, bk, warps, stages) == tuple(exact)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        x = w = h = None
        torch.cuda.empty_cache()
    sk = [r for r in rows if r.get("impl") == "skinny" and "identical" in r]
    summary = {
        "configs_run": len(sk), "all_identical": all(r["identical"] for r in sk),
        "identical_with_other_block_k": [r["config"] for r in sk if r["identical"] and r["config"][2] != r["decode_block_k"]][:20],
        "differing_configs": [(r["shape"], r["config"], r["differing"]) for r in sk if not r["identical"]][:40],
        "best_identical_tflops": {s: max(((r["tflops"], r["config"]) for r in sk if r["shape"] == s and r["identical"]),
                                         default=None) for s in SHAPES},
        "best_identical_decode_block_k_tflops": {
            s: max(((r["tflops"], r["config"]) for r in sk if r["shape"] == s and r["identical"]
                    and r["config"][2] == r["decode_block_k"]), default=None) for s in SHAPES},
        "chosen": {s: next(((r["tflops"], r["config"]) for r in sk if r["shape"] == s and r["chosen_for_exact_prefill"]),
                           None) for s in SHAPES},
        "cublas_tflops": {r["shape"]: r["tflops"] for r in rows if r.get("impl") == "cublas"},
    }
    return {"rows_m": m, "summary": summary, "results": rows}


def _model_flops(spec, prompt: int) -> float:
    h, inter, q = spec.hidden_size, spec.intermediate_size, spec.num_heads * spec.head_dim
    kvd = spec.num_kv_heads * spec.head_dim
    per_token = 2 * spec.num_layers * (h * (q + 2 * kvd) + q * h + 3 * h * inter)
    attention = 4 * spec.num_layers * q * prompt * (prompt + 1) / 2      # QK and PV, causal
    return per_token * prompt + attention + 2 * h * spec.vocab_size      # + one row's logits


def plan(seq_specs):
    """A step's schedule from (tokens, num_computed, tokens_this_step, pages) per sequence."""
    from kvhold.executor.scheduler import Scheduled
    from kvhold.executor.sequence import Sequence
    from kvhold.protocol.sampling import SamplingParams

    out = []
    for slot, (tokens, computed, n, pages) in enumerate(seq_specs):
        seq = Sequence(slot=slot, request_id=slot + 1, prompt_len=len(tokens), tokens=tokens,
                       sampling=SamplingParams(max_tokens=9, seed=0, temperature=0.0, ignore_eos=True))
        seq.num_computed, seq.pages = computed, pages
        out.append(Scheduled(seq, n))
    return out


def synthetic_model(layers: int):
    """Llama-3-8B's shapes with `layers` decoder layers, random bf16 weights made on the GPU
    in one buffer in config order (q|k|v and gate|up adjacent, as the sidecar's region
    holds them): (spec, weights), no checkpoint on disk."""
    import tempfile

    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.testing.make_model import make_config

    cfg = make_config("llama3-8b", 128256, 1, 2)
    cfg["num_hidden_layers"] = layers
    path = Path(tempfile.mkdtemp(prefix="kvh-synthetic-"))
    (path / "config.json").write_text(json.dumps(cfg))
    spec = ModelSpec.from_dir(path)
    shapes = spec.expected_tensors()
    buf = torch.empty(sum(int(torch.Size(s).numel()) for s in shapes.values()), dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights, offset = {}, 0
    for name, shape in shapes.items():
        t = buf[offset:offset + torch.Size(shape).numel()].view(shape)
        offset += t.numel()
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        weights[name] = t
    return spec, weights, path


def prefill(args, save) -> dict:
    from kvhold.executor.cuda.runner import CudaRunner
    from kvhold.executor.kv_cache import KvCache
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.layout import KvGeometry
    from kvhold.protocol.model_spec import ModelSpec
    from tools.bench_engine_setup import load_weights

    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    prompts = [int(p) for p in args.prompts.split(",")]
    chunks = [int(c) for c in args.chunks.split(",")]
    longest = max(prompts)
    if args.model is not None:
        spec = ModelSpec.from_dir(args.model)
        weights = load_weights(args.model, "cuda")
    else:
        spec, weights, _ = synthetic_model(args.synthetic_layers)
    model = LlamaModel(spec, weights, torch.bfloat16, torch.device("cuda"), longest + 64)
    page = 16
    pages = list(range(1, 1 + -(-longest // page)))
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "bfloat16", page),
                         len(pages) + 2, "cuda")
    out = {"model": str(args.model) if args.model else f"Llama-3-8B shapes, {args.synthetic_layers} layers, random",
           "peak_tflops": args.peak_tflops, "prefill": [], "decode_step_ms": {},
           "identity": {}}
    rng = random.Random(0)
    tokens = [rng.randrange(3, spec.vocab_size) for _ in range(longest)]
    t0 = time.monotonic()
    from kvhold.executor.cuda import attention as cuda_attention

    for mode in args.modes.split(","):
        exact = mode != "fast"
        cuda_attention.PREFILL_PACKED = mode == "exact_packed"
        for chunk in chunks:
            if time.monotonic() - t0 > args.budget_s:
                break
            runner = CudaRunner(model, kv, max_batch=64, prefill_chunk=chunk, max_pages_per_seq=len(pages) + 1,
                                exact=exact)
            assert runner.exact == exact, runner.exact_refusal
            warm = time.monotonic()
            runner.prepare()
            out.setdefault("prepare_s", {})[f"{mode}_{chunk}"] = round(time.monotonic() - warm, 2)
            if chunk == chunks[0]:
                for b, (graph, _, _) in runner.graphs.items():
                    out["decode_step_ms"][f"{mode}_{b}"] = round(_time(graph.replay, 20) * 1e3, 3)
            for prompt in prompts:
                def run():
                    done = 0
                    while done < prompt:
                        n = min(chunk - done % chunk, prompt - done)
                        runner.run(plan([(tokens[:done + n], done, n, pages)]))
                        done += n
                run()
                torch.cuda.synchronize()
                s = time.monotonic()
                reps = 3 if prompt <= 2048 else 1
                for _ in range(reps):
                    run()
                torch.cuda.synchronize()
                t = (time.monotonic() - s) / reps
                flops = _model_flops(spec, prompt)
                row = {"mode": mode, "exact": exact, "chunk": chunk, "prompt": prompt, "seconds": round(t, 4),
                       "tokens_per_s": round(prompt / t), "tflops": round(flops / t / 1e12, 1),
                       "mfu": round(flops / t / 1e12 / args.peak_tflops, 3)}
                out["prefill"].append(row)
                print(json.dumps(row), flush=True)
                save(out)
            if chunk == max(chunks):         # the bits, exact or not (fast: the control)
                out["identity"][mode] = _identity(runner, tokens[:min(args.identity_len, chunk)], pages, plan)
                print(json.dumps({"identity": {mode: out["identity"][mode]}}), flush=True)
            runner = None
            torch.cuda.empty_cache()
    cost = {}
    for r in out["prefill"]:
        if r["exact"]:
            other = next((o for o in out["prefill"] if not o["exact"] and o["chunk"] == r["chunk"]
                          and o["prompt"] == r["prompt"]), None)
            if other:
                cost[f"{r['mode']}_chunk{r['chunk']}_prompt{r['prompt']}"] = round(
                    1 - r["tokens_per_s"] / other["tokens_per_s"], 3)
    out["exact_throughput_cost"] = cost
    return out


def _identity(runner, tokens, pages, plan) -> dict:
    """Single prefill vs random chunks vs decode steps: KV pages and logits, bit for bit."""
    pool, page = runner.kv.pool, runner.kv.page_tokens
    length = len(tokens)

    def kv():
        return torch.stack([pool[pages[p // page], :, :, p % page] for p in range(length)]).clone()

    def chunked(sizes):
        pool[pages] = 0
        done, logits = 0, {}
        for n in sizes:
            logits[done + n - 1] = runner.run(plan([(tokens[:done + n], done, n, pages)]))[0].clone()
            done += n
        return logits, kv()

    single_logits, single_kv = chunked([length])
    rng = random.Random(1)
    sizes, left = [], length
    while left:
        sizes.append(min(left, rng.randrange(1, min(300, runner.prefill_chunk) + 1)))
        left -= sizes[-1]
    chunk_logits, chunk_kv = chunked(sizes)
    first = length - 24                     # the last 24 positions by decode steps
    dec_logits, _ = chunked([first] + [1] * (length - first))
    dec_kv = kv()
    same = lambda a, b: bool(torch.equal(_bits(a), _bits(b)))      # noqa: E731
    return {"length": length, "chunks": sizes,
            "kv_single_vs_chunked": same(single_kv, chunk_kv), "kv_single_vs_decode": same(single_kv, dec_kv),
            "logits_single_vs_chunked": same(single_logits[length - 1], chunk_logits[length - 1]),
            "logits_single_vs_decode": same(single_logits[length - 1], dec_logits[length - 1]),
            "logits_chunk_ends_vs_decode": all(same(v, dec_logits[p]) for p, v in chunk_logits.items() if p in dec_logits)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gemm", action="store_true")
    p.add_argument("--prefill", action="store_true")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--model", type=Path, help="a checkpoint; default: Llama-3-8B's shapes, random (--synthetic-layers)")
    p.add_argument("--synthetic-layers", type=int, default=8)
    p.add_argument("--modes", default="fast,exact_packed,exact")
    p.add_argument("--prompts", default="512,2048,8192")
    p.add_argument("--chunks", default="512,2048")
    p.add_argument("--identity-len", type=int, default=1200)
    p.add_argument("--peak-tflops", type=float, default=790.0, help="the bf16 peak MFU is taken against")
    p.add_argument("--budget-s", type=float, default=120)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_exact needs a CUDA device", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": "python -m tools.probe_exact " + " ".join(sys.argv[1:] if argv is None else argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    import triton
    result["triton"] = triton.__version__
    if args.gemm:
        result["gemm"] = gemm(args)
        print(json.dumps(result["gemm"]["summary"], indent=1), flush=True)
    if args.prefill:
        def save(part):               # after each measurement: a run cut short keeps what it measured
            result["prefill"] = part
            args.out.write_text(json.dumps(result, indent=1) + "\n")

        result["prefill"] = prefill(args, save)
        print(json.dumps({k: v for k, v in result["prefill"].items() if k != "prefill"}, indent=1), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
