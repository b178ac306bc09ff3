"""Probe: the exact-prefill GEMM's tiles by row count, on the GPU.

    python -m tools.probe_prefill_tiles --out bench/results/prefill_tiles_cuda.json
    python -m tools.probe_prefill_tiles --rows 512,2048 --budget-s 60 --out /tmp/tiles.json

An exact prefill chunk runs its projections on kvhold.executor.cuda.gemm's kernel in big
tiles (`prefill_tiles`). The tile only says which program computes which elements, so any
tile gives a row the decode's bits; but how many programs a tile makes depends on the rows:
at 512 rows a 128 x 256 tile of o_proj or down_proj (N = 4,096) makes 64 programs for 132
SMs. For each of Llama-3-8B's four shapes (q|k|v, o, gate|up, down) and each --rows, this
times a fixed list of candidate tiles (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; grouped
program order), checks each against the decode's tiles bit for bit (64-row blocks as a
decode step computes them), and times cuBLAS at the same shape. Writes JSON: one row per
(shape, rows, tile) with TFLOP/s and `identical`; per (shape, rows) the fastest identical
tile and what kvhold chooses today (`chosen`).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tools.probe_exact import SHAPES, _bits, _time

CANDIDATES = [(256, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 3),
              (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (64, 256, 64, 8, 3), (64, 256, 64, 4, 4),
              (64, 128, 64, 4, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4),
              (128, 128, 128, 8, 3), (64, 128, 128, 4, 3)]


def probe(rows_list: list[int], budget_s: float, reps: int) -> dict:
    from kvhold.executor.cuda import gemm as cuda_gemm

    t0 = time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results, best = [], {}
    complete = True
    for name, (n, k, residual) in SHAPES.items():
        mmax = max(rows_list)
        x_all = torch.randn((mmax, k), generator=gen, device="cuda", dtype=torch.bfloat16)
        w = torch.randn((n, k), generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        h_all = torch.randn((mmax, n), generator=gen, device="cuda", dtype=torch.bfloat16)
        for m in rows_list:
            x, h = x_all[:m], h_all[:m]
            flops = 2 * m * n * k
            ref = []
            for i in range(0, m, 64):                  # as decode steps of 64 rows compute them
                r = h[i:i + 64].clone() if residual else None
                ref.append(cuda_gemm.skinny(x[i:i + 64], w, residual=r, out=r))
            ref = _bits(torch.cat(ref))
            hb = h.clone()
            t = _time((lambda: hb.addmm_(x, w.t())) if residual else (lambda: F.linear(x, w)), reps)
            cublas = round(flops / t / 1e12, 1)
            chosen = tuple(cuda_gemm.prefill_tiles(n, k))
            rows = []
            for cfg in [chosen] + [c for c in CANDIDATES if c != chosen]:
                if time.monotonic() - t0 > budget_s:
                    complete = False
                    break
                bm, bn, bk, warps, stages = cfg
                if k % bk:
                    continue
                out = h.clone() if residual else None

                def run():
                    return cuda_gemm.skinny(x, w, residual=out, out=out, block_n=bn, block_k=bk,
                                            num_warps=warps, num_stages=stages, rows_per_program=bm,
                                            group_m=cuda_gemm.PREFILL_GROUP_M)
                try:
                    got = (cuda_gemm.skinny(x, w, residual=h.clone(), out=None, block_n=bn, block_k=bk,
                                            num_warps=warps, num_stages=stages, rows_per_program=bm,
                                            group_m=cuda_gemm.PREFILL_GROUP_M) if residual else run())
                    t = _time(run, reps)
                except Exception as exc:        # out of shared memory or registers: say so, go on
                    results.append({"shape": name, "rows": m, "config": list(cfg),
                                    "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                    continue
                row = {"shape": name, "n": n, "k": k, "rows": m, "config": list(cfg),
                       "programs": -(-m // bm) * -(-n // bn), "tflops": round(flops / t / 1e12, 1),
                       "identical": bool(torch.equal(_bits(got), ref)), "chosen": cfg == chosen}
                rows.append(row)
                results.append(row)
                print(json.dumps(row), flush=True)
            ok = [r for r in rows if r["identical"]]
            top = max(ok, key=lambda r: r["tflops"]) if ok else None
            now = next((r for r in rows if r["chosen"]), None)
            best[f"{name}@{m}"] = {"cublas_tflops": cublas,
                                   "chosen": now and [now["config"], now["tflops"]],
                                   "fastest_identical": top and [top["config"], top["tflops"]],
                                   "all_identical": all(r["identical"] for r in rows)}
        x_all = w = h_all = None
        torch.cuda.empty_cache()
    return {"results": results, "best": best, "complete": complete,
            "all_identical": all(r.get("identical", True) for r in results)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--rows", default="512,1024,2048,4096,8192",
                   help="row counts (tokens of a prefill step) to probe, comma-separated")
    p.add_argument("--budget-s", type=float, default=240.0, help="stop starting new tiles after this long")
    p.add_argument("--reps", type=int, default=5, help="timed launches per tile (after one warm-up)")
    p.add_argument("--out", required=True, help="JSON file to write")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",") if r]
    if not rows or min(rows) <= 0:
        p.error("--rows: positive integers")
    import triton
    out = {"command": "python -m tools.probe_prefill_tiles " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "host": platform.node(), **probe(rows, args.budget_s, args.reps)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out["best"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
