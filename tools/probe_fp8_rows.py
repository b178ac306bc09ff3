"""Does a row of the FP8 kernel (kvhold.executor.cuda.fp8_gemm) keep its bits at every row count?
One GPU, under a minute.

    python -m tools.probe_fp8_rows [--no-block] [--bf16-out] > bench/results/fp8_kernel_rows_cuda.txt

For each row count r in 1..256 (every decode bucket; past 64 rows the wide decode tile or the
exact-prefill tiles, as gemm.wide says) it runs
x[:r] @ dequant(w).T and says whether row 0's bits equal those at r = 1. The output is stored in
float32 (out_ptr float32: the kernel's fp32 accumulator itself, no bf16 rounding to hide a
last-bit difference); --bf16-out adds the engine's bf16 output for the two main variants.

Columns (1536 x 512 weight, as tests/gpu/test_gpu_fp8.py):
  cur    kvhold/executor/cuda/fp8_gemm.py's kernel without its opaque 16-bit move, per-channel
         scales: mma.sync operands at the FP8 load's kWidth 4
  fix    the kernel as served, with the move (`_KEEP_16_BIT`, a mov.b16 on the dequantized tile):
         mma.sync operands at kWidth 2, as the bf16 kernel's
  bm64   the current kernel but 64 rows a program at every decode row count (wgmma everywhere;
         the other possible fix)
  bf16   gemm.exact_linear on the dequantized bf16 weight (the bf16 kernel, for reference)
  cur/b  fix/b  as cur and fix with 128x128 block scales
A cell is '.' when row 0 equals r = 1's bit for bit, else the number of its 1536 elements that
differ. The summary also says, per column, whether every row (not just row 0) at each count
equals the 600-row result (the prefill tiles), and whether fix equals the bf16 path.
Both are built from the current source in a temporary folder.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import sys
import tempfile
import time

import torch
import triton

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "kvhold" / "executor" / "cuda" / "fp8_gemm.py"
DEQ = "        w = (w.to(tl.float32) * scale).to(x_ptr.dtype.element_ty)\n"
FIX = ('        w = tl.inline_asm_elementwise("mov.b16 $0, $1;", "=h,h", [w], dtype=x_ptr.dtype.element_ty,\n'
       '                                      is_pure=False, pack=1)\n')
N, K, ROWS, REF_ROWS = 1536, 512, 256, 600


def _variants() -> dict:
    """{'cur': module without the fix, 'fix': module with it}, each from the current source."""
    src = SRC.read_text()
    # strip the patch's form of the fix if the tree has it (two lines after the dequantize line)
    unfixed = re.sub(r"(?m)^        w = tl\.inline_asm_elementwise\(_KEEP_16_BIT.*\n.*\n", "", src)
    assert DEQ in unfixed, "fp8_gemm.py's dequantize line moved: update tools/probe_fp8_rows.py"
    fixed = unfixed.replace(DEQ, DEQ + FIX)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="fp8rows_"))
    mods = {}
    for name, text in (("cur", unfixed), ("fix", fixed)):
        path = tmp / f"fp8_gemm_{name}.py"
        path.write_text(text)
        spec = importlib.util.spec_from_file_location(f"fp8_gemm_{name}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)          # triton.jit reads the source from this file
        mods[name] = mod
    return mods


def fp8_launch(mod, x, w, scale, block, out_dtype, bm=None):
    """fp8_gemm.fp8_linear(x, w, scale, block) into a new `out_dtype` tensor; `bm`: rows a program
    at up to 64 rows (instead of gemm.block_m's 16/32/64)."""
    from kvhold.executor.cuda import gemm
    m, k = x.shape
    n = w.shape[0]
    tbm, bn, bk, warps, stages, group_m = mod._tiles(n, k, m, block[1] if block else k)
    if bm and m <= gemm.MAX_ROWS:
        tbm = bm
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid = (triton.cdiv(n, bn) * triton.cdiv(m, tbm),) if group_m else (triton.cdiv(n, bn), triton.cdiv(m, tbm))
    mod._fp8_kernel[grid](
        x, w, scale, out, out, m, n, k, x.stride(0), w.stride(0), scale.stride(0) if block else 0, out.stride(0),
        out.stride(0), BLOCK_M=tbm, BLOCK_N=bn, BLOCK_K=bk, RESIDUAL=False, EVEN_N=n % bn == 0,
        SCALE_BN=block[0] if block else 0, SCALE_BK=block[1] if block else 1,
        num_warps=warps, num_stages=stages, GROUP_M=group_m)
    return out


def bf16_launch(x, dense, out_dtype):
    from kvhold.executor.cuda import gemm
    out = torch.empty((x.shape[0], dense.shape[0]), dtype=out_dtype, device=x.device)
    return gemm.exact_linear(x, dense, out=out)


def tile_of(r: int) -> str:
    from kvhold.executor.cuda import gemm
    bm = gemm.block_m(r) if r <= gemm.MAX_ROWS or gemm.wide(r) else gemm.prefill_tiles(N, K)[0]
    return f"BM{bm:<3d} {'mma.sync' if bm < 64 else 'wgmma'}"


def _ranges(rs: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(rs):
        if start is None:
            start = r
        if i + 1 == len(rs) or rs[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ",".join(out) or "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-block", action="store_true", help="skip the block-scale columns (fewer compiles)")
    ap.add_argument("--bf16-out", action="store_true", help="also compare the bf16 outputs of cur and fix")
    args = ap.parse_args()
    t0 = time.time()
    mods = _variants()
    dev = torch.device("cuda")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    torch.manual_seed(0)
    w = (torch.randn(N, K, device=dev) * 0.3).to(torch.float8_e4m3fn)
    s_ch = torch.rand(N, device=dev) * 0.02 + 0.001
    s_bl = torch.rand(-(-N // 128), K // 128, device=dev) * 0.02 + 0.001
    blk = (128, 128)
    dense = (w.float() * s_ch[:, None]).to(torch.bfloat16)       # the kernel's arithmetic, in memory
    x = torch.randn(REF_ROWS, K, device=dev, dtype=torch.bfloat16)
    f32 = torch.float32
    cols = {
        "cur": lambda xs: fp8_launch(mods["cur"], xs, w, s_ch, None, f32),
        "fix": lambda xs: fp8_launch(mods["fix"], xs, w, s_ch, None, f32),
        "bm64": lambda xs: fp8_launch(mods["cur"], xs, w, s_ch, None, f32, bm=64),
        "bf16": lambda xs: bf16_launch(xs, dense, f32),
    }
    if not args.no_block:
        cols["cur/b"] = lambda xs: fp8_launch(mods["cur"], xs, w, s_bl, blk, f32)
        cols["fix/b"] = lambda xs: fp8_launch(mods["fix"], xs, w, s_bl, blk, f32)
    if args.bf16_out:
        cols["cur16"] = lambda xs: fp8_launch(mods["cur"], xs, w, s_ch, None, torch.bfloat16)
        cols["fix16"] = lambda xs: fp8_launch(mods["fix"], xs, w, s_ch, None, torch.bfloat16)
    row0, all_rows_vs_ref, results = {}, {}, {}
    for name, fn in cols.items():
        ref = fn(x)                                        # 600 rows: the prefill tiles
        first = fn(x[:1])[0].clone()
        results[name], all_rows_vs_ref[name] = {}, []
        for r in range(1, ROWS + 1):
            out = fn(x[:r])
            if name in ("cur", "fix", "bf16"):
                results[name][r] = out
            row0.setdefault(name, {})[r] = int((out[0] != first).sum().item())
            if not torch.equal(out, ref[:r]):
                all_rows_vs_ref[name].append(r)
        torch.cuda.synchronize()
        print(f"  {name}: done at {time.time() - t0:.1f} s", flush=True)
    names = list(cols)
    print("\nrow 0 at r rows vs r = 1 ('.' same bits, else elements of 1536 that differ); fp32 accumulator")
    print(f"{'rows':>4}  {'tile (fp8 kernel)':<17}" + "".join(f"{n:>7}" for n in names))
    for r in range(1, ROWS + 1):
        cells = "".join(f"{('.' if row0[n][r] == 0 else str(row0[n][r])):>7}" for n in names)
        print(f"{r:>4}  {tile_of(r):<17}{cells}")
    print("\nsummary")
    for n in names:
        bad = [r for r in range(1, ROWS + 1) if row0[n][r]]
        print(f"  {n:>6}: row 0 differs from r=1 at r = {_ranges(bad)};"
              f" some row differs from the 600-row result at r = {_ranges(all_rows_vs_ref[n])}")
    same = [r for r in range(1, ROWS + 1) if torch.equal(results["fix"][r], results["bf16"][r])]
    print(f"  fix == bf16 path (dequantized weight, bf16 kernel), all rows, bit for bit at "
          f"{len(same)}/{ROWS} row counts; differs at r = {_ranges(sorted(set(range(1, ROWS + 1)) - set(same)))}")
    same = [r for r in range(1, ROWS + 1) if torch.equal(results["cur"][r], results["bf16"][r])]
    print(f"  cur == bf16 path at {len(same)}/{ROWS} row counts")
    print(f"total {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
