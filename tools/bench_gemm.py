"""Benchmark: a decode step's weight GEMMs at small batch, cuBLAS against the skinny kernel.

    python -m tools.bench_gemm --device cuda:0 [--rows 1,8,16,64] [--sweep]

For each projection of a Llama-3-8B layer (q|k|v, o, gate|up, down; lm_head once) and
each row count, one CUDA graph multiplies the rows by 32 distinct weight matrices, as
the 32 layers of a step do (so the weights stream from HBM, not from L2), and is
replayed: time per GEMM, and the bandwidth it reaches against the device's copy
bandwidth. Implementations: cuBLAS through F.linear / addmm_ (torch's default BLAS
library and cuBLASLt), and kvhold.executor.cuda.gemm's kernel at its chosen tile sizes, or
with --sweep over a grid of tile sizes, warps and pipeline stages (how those were
chosen). Each kernel's output is checked against cuBLAS. Writes JSON under
bench/results/.

`--fp8 rows|block` times kvhold.executor.cuda.fp8_gemm's kernel instead, on FP8 weights with
one scale per output row (FP8-Dynamic checkpoints) or per 128x128 block: the bytes read are one
a weight, so its bandwidth is counted on those; cuBLAS runs on the dequantized bf16 weights
(what a bf16 checkpoint's step reads), and each FP8 output is checked against F.linear of the
dequantized weight. With --sweep, the FP8 kernel over FP8_GRID (BLOCK_K 128 with block scales). `--model 70b` times
Llama-3-70B's shapes instead of -8B's. The JSON is rewritten after each shape, so a run cut
short keeps what it measured:

    python -m tools.bench_gemm --fp8 rows --model 70b --sweep --out bench/results/gemm_fp8_70b_cuda.json

Rows past 64 (up to 256: a decode step's on `exact_linear`) time the 64-row decode tile over row
blocks (`wide`) and the prefill tiles (`prefill`), the one `exact_linear` takes today marked
`current`, with --sweep also
WIDE_GRID, each with its TFLOP/s and whether every row has the 64-row decode tile's bits (a tile that
does not cannot serve a decode step):

    python -m tools.bench_gemm --rows 64,128,256 --sweep --sweep-rows 128,256 --shapes qkv,o,gate_up,down
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from tools.bench_decode import copy_bandwidth

# name: (N, K, adds into the residual)
SHAPES = {"qkv": (6144, 4096, False), "o": (4096, 4096, True), "gate_up": (28672, 4096, False),
          "down": (4096, 14336, True), "lm_head": (128256, 4096, False)}
# Llama-3-70B's (--model 70b): hidden 8192, 64 query heads and 8 KV heads of 128, intermediate 28672
SHAPES_70B = {"qkv": (10240, 8192, False), "o": (8192, 8192, True), "gate_up": (57344, 8192, False),
              "down": (8192, 28672, True), "lm_head": (128256, 8192, False)}
LAYERS = 32
# the grid --sweep times at --sweep-rows past 64 (a decode step of 65..256 rows): (BLOCK_M, BLOCK_N,
# BLOCK_K, warps, stages), the row tiles of one column tile launched next to each other
WIDE_GRID = ((64, 64, 128, 4, 4), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (64, 256, 64, 8, 3),
             (128, 64, 64, 4, 4), (128, 64, 128, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4),
             (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 64, 64, 8, 3), (256, 128, 64, 8, 3))
# --fp8 --sweep's grid: (BLOCK_N, BLOCK_K, warps, stages)
FP8_GRID = tuple(itertools.product((16, 32, 64, 128), (256, 512), (4, 8), (3, 4)))


def time_graph(fn, replays: int = 20) -> float:
    """Seconds per replay of a CUDA graph of fn() (which launches one GEMM per layer)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / replays


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rows", default="1,8,16,64")
    p.add_argument("--sweep-rows", default="8,64", help="row counts --sweep times the grid at")
    p.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    p.add_argument("--model", choices=("8b", "70b"), default="8b", help="whose layer shapes: Llama-3-8B's or -70B's")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile sizes, warps and stages at --sweep-rows (not for lm_head)")
    p.add_argument("--fp8", choices=("rows", "block"), default=None,
                   help="time the FP8 kernel on FP8 weights (per-row or 128x128 block scales)")
    p.add_argument("--out", type=Path, default=Path("bench/results/gemm_cuda.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm needs a CUDA device", file=sys.stderr)
        return 2
    from kvhold.executor.cuda import gemm as cuda_gemm

    dev = torch.device(args.device)
    torch.cuda.set_device(dev)
    bw = copy_bandwidth(args.device)
    rows_list = [int(r) for r in args.rows.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",")}
    results, gen = [], torch.Generator(device=dev).manual_seed(0)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    block = (128, 128) if args.fp8 == "block" else None      # FP8 block scales (--fp8 block)
    shapes = SHAPES_70B if args.model == "70b" else SHAPES

    def write():            # after every shape, so that a run cut short keeps what it measured
        best = {}
        for r in results:
            if "us" in r:
                key = f"{r['shape']}@{r['rows']}"
                if key not in best or r["us"] < best[key]["us"]:
                    best[key] = r
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "command": "python -m tools.bench_gemm " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "model_shapes": args.model,
            "copy_bandwidth_tb_per_s": round(bw / 1e12, 3), "layers": LAYERS,
            "best": best, "rows": results}, indent=1))
        return best

    for name in args.shapes.split(","):
        n, k, residual = shapes[name]
        if args.fp8 and name == "lm_head":      # an FP8 checkpoint keeps its lm_head in bf16
            continue
        layers = 2 if name == "lm_head" else LAYERS
        ws = [torch.randn((n, k), generator=gen, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        nbytes = n * k * 2
        if args.fp8:        # FP8 weights read by the kernel (their scales not counted); cuBLAS on the dequantized bf16
            from kvhold.executor.cuda import fp8_gemm
            from kvhold.executor.fp8 import Fp8Weight
            from kvhold.testing.make_model import quantize_fp8

            quant = [quantize_fp8(w, "fp8-block" if block else "fp8-dynamic", torch.float32) for w in ws]
            fp8 = [(q, next(iter(sc.values())).reshape(-1) if block is None else next(iter(sc.values())))
                   for q, sc in quant]
            del quant
            ws = [Fp8Weight(name, q, s_, "block" if block else "channel", block).dequantize(torch.bfloat16)
                  for q, s_ in fp8]
            nbytes = n * k

        def record(impl, m, seconds, config=None, error=None, max_err=None, same_as_16_rows=None,
                   same_as_decode_tile=None):
            row = {"shape": name, "n": n, "k": k, "rows": m, "impl": impl, "config": config}
            read = nbytes if impl.startswith("fp8") else n * k * 2     # cuBLAS reads the bf16 weight
            if seconds is not None:
                row.update(us=round(seconds / layers * 1e6, 2),
                           tb_per_s=round(read * layers / seconds / 1e12, 3),
                           of_copy_bw=round(read * layers / seconds / bw, 3))
            if max_err is not None:
                row["max_rel_err_vs_cublas"] = max_err
            if same_as_16_rows is not None:
                row["rows_bit_identical_to_batch_8"] = same_as_16_rows
            if same_as_decode_tile is not None:
                row["bit_identical_to_decode_tile"] = same_as_decode_tile
            if seconds is not None and m > 64:     # past 64 rows the FLOPs count as much as the bytes
                row["tflops"] = round(2 * m * n * k * layers / seconds / 1e12, 1)
            if error:
                row["error"] = error
            results.append(row)
            print(json.dumps(row), flush=True)

        def cublas_fn(x, h):
            if residual:
                return lambda: [h.addmm_(x, w.t()) for w in ws]
            return lambda: [F.linear(x, w) for w in ws]

        def kernel(x, i, cfg, **kw):
            if args.fp8:
                q, sc = fp8[i]
                return fp8_gemm.fp8_linear(x, q, sc, block, **{key: v for key, v in cfg.items()
                                                              if key != "rows_per_program"}, **kw)
            return cuda_gemm.skinny(x, ws[i], **cfg, **kw)

        def skinny_fn(x, h, cfg):
            if residual:
                return lambda: [kernel(x, i, cfg, residual=h, out=h) for i in range(len(ws))]
            return lambda: [kernel(x, i, cfg) for i in range(len(ws))]

        def check(x, cfg):
            ref = F.linear(x, ws[0]).float()
            got = kernel(x, 0, cfg).float()
            return round(((got - ref).abs().max() / ref.abs().max()).item(), 5)

        def wide_rows(m, x, h, sweep):
            """A decode step of 65..256 rows (exact_linear): the 64-row decode tile over row blocks
            (`wide`) and the prefill tiles (`prefill`), the one exact_linear takes today marked
            `current`, and with `sweep` WIDE_GRID; each checked bit for bit against the 64-row decode
            tile's blocks (what a row gives at 64 rows), which any tile must match to serve a decode step."""
            ref = torch.cat([cuda_gemm.skinny(x[i:i + cuda_gemm.MAX_ROWS], ws[0])
                             for i in range(0, m, cuda_gemm.MAX_ROWS)])
            bm, bn, bk, nw, ns = cuda_gemm.prefill_tiles(n, k)
            configs = [("wide", dict(rows_per_program=cuda_gemm.MAX_ROWS, group_m=cuda_gemm.WIDE_GROUP_M)),
                       ("prefill", dict(rows_per_program=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns,
                                        group_m=cuda_gemm.PREFILL_GROUP_M))]
            if sweep:
                configs += [("tile", dict(rows_per_program=bm_, block_n=bn_, block_k=bk_, num_warps=nw_,
                                          num_stages=ns_, group_m=max(1, m // bm_)))
                            for bm_, bn_, bk_, nw_, ns_ in WIDE_GRID if bm_ <= m]
            current = "wide" if cuda_gemm.wide(m) else "prefill"
            for impl, cfg in configs:
                if n % cfg.get("block_n", 1) or k % cfg.get("block_k", 1):
                    continue
                try:
                    same = bool(torch.equal(kernel(x, 0, cfg), ref))
                    record(impl, m, time_graph(skinny_fn(x, h, cfg)), dict(cfg, current=impl == current),
                           max_err=check(x, cfg), same_as_decode_tile=same)
                except Exception as exc:  # a tile that does not fit (shared memory): recorded, skipped
                    record(impl, m, None, cfg, error=f"{type(exc).__name__}: {str(exc)[:160]}")

        for m in rows_list:
            x = torch.randn((m, k), generator=gen, device=dev, dtype=torch.bfloat16)
            h = torch.randn((m, n), generator=gen, device=dev, dtype=torch.bfloat16)
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                record(lib, m, time_graph(cublas_fn(x, h)))
            torch.backends.cuda.preferred_blas_library("cublas")
            if m > cuda_gemm.MAX_ROWS:
                if not args.fp8 and m <= cuda_gemm.MAX_DECODE_ROWS and name != "lm_head":
                    wide_rows(m, x, h, args.sweep and m in sweep_rows)
                continue
            default = dict(block_n=cuda_gemm.BLOCK_N, block_k=cuda_gemm.BLOCK_K, num_warps=cuda_gemm.NUM_WARPS,
                           num_stages=cuda_gemm.NUM_STAGES)
            if args.fp8:        # the kernel's own tiles at this row count, then the grid
                _, bn, bk, nw, ns, _ = fp8_gemm._tiles(n, k, m, block[1] if block else k)
                default = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
            configs = [default]
            if m > 16 and not args.fp8:     # the same arithmetic per row as at 16 rows: 16 rows per program
                configs.append(dict(default, rows_per_program=16))
            if args.sweep and m in sweep_rows and name != "lm_head" and args.fp8:
                configs += [dict(block_n=bn, block_k=bk if not block else 128, num_warps=nw, num_stages=ns)
                            for bn, bk, nw, ns in FP8_GRID if not (block and bk != 256)]
            elif args.sweep and m in sweep_rows and name != "lm_head":
                configs += [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns) for bn, bk, nw, ns in
                            itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 5))]
            impl = f"fp8-{args.fp8}" if args.fp8 else "skinny"
            for cfg in configs:
                if n % cfg["block_n"] or k % cfg["block_k"]:
                    continue
                try:
                    err = check(x, cfg)
                    seconds = time_graph(skinny_fn(x, h, cfg))
                    # does a row come out the same as it would in a batch of 8 (16 rows per program)?
                    # (not timed for FP8: tests/gpu/test_gpu_fp8.py checks its bits at every row count)
                    same = None if args.fp8 else bool(torch.equal(
                        kernel(x, 0, cfg)[:min(m, 8)], kernel(x[:8], 0, dict(cfg, rows_per_program=16))[:m]))
                    record(impl, m, seconds, cfg, max_err=err, same_as_16_rows=same)
                except Exception as exc:  # a tile that does not fit (shared memory): recorded, skipped
                    record(impl, m, None, cfg, error=f"{type(exc).__name__}: {str(exc)[:160]}")
        ws.clear()                      # free this shape's weights before the next
        if args.fp8:
            fp8.clear()
        torch.cuda.empty_cache()
        write()
    best = write()
    for key, r in best.items():
        print(f"best {key:>12}: {r['impl']:>8} {r['us']:8.2f} us  {r['of_copy_bw']:.2f} of copy bw  {r.get('config')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
