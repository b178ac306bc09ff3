"""Probe: what a prefill chunk's attention costs the first time each key length is seen.

    python -m tools.probe_prefill_attention [--chunk 512] [--lengths 512,1024,...]

CudaRunner runs a prefill chunk's attention through F.scaled_dot_product_attention with a
boolean mask, at a key length equal to the chunk's context. On a fresh H200 the first
active executor was fenced for "hang" a second or two into its first prefill, though it
had warmed the prefill path on one padding chunk. This probe times, in a fresh process
per backend setting (library loading is per process), each key length's first call and a
repeat call, at Llama-3-8B's head shapes, and records which backend torch picks. Writes
JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BACKENDS = ("default", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def child(backend: str, chunk: int, lengths: list[int], heads: int, dim: int) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda:0")
    torch.zeros(1, device=dev)
    rows = []
    ctx = sdpa_kernel([getattr(SDPBackend, backend)]) if backend != "default" else None
    if ctx is not None:
        ctx.__enter__()
    for keys in lengths:
        q = torch.randn((1, heads, chunk, dim), device=dev, dtype=torch.bfloat16)
        k = torch.randn((1, heads, keys, dim), device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        first = keys - chunk
        mask = (torch.arange(keys, device=dev)[None, :] <= first + torch.arange(chunk, device=dev)[:, None])
        choice = int(torch._fused_sdp_choice(q, k, v, mask[None, None]))
        times = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
            torch.cuda.synchronize()
            times.append(round((time.perf_counter() - t) * 1e3, 2))
        rows.append({"keys": keys, "first_ms": times[0], "repeat_ms": times[1], "choice": choice})
    return {"backend": backend, "torch": torch.__version__,
            "cudnn_sdp_enabled": torch.backends.cuda.cudnn_sdp_enabled(),
            "choice_names": {int(v): name for name, v in SDPBackend.__members__.items()}, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--lengths", default="512,1024,1536,2048,700,1100,1300,1700,1900,2040")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("bench/results/prefill_attention_cuda.json"))
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.child:
        print(json.dumps(child(args.child, args.chunk, lengths, args.heads, args.head_dim)))
        return 0
    runs = []
    for backend in args.backends.split(","):
        proc = subprocess.run([sys.executable, "-m", "tools.probe_prefill_attention", "--child", backend,
                               "--chunk", str(args.chunk), "--lengths", args.lengths,
                               "--heads", str(args.heads), "--head-dim", str(args.head_dim)],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode:
            runs.append({"backend": backend, "error": proc.stderr[-1500:]})
        else:
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python -m tools.probe_prefill_attention "
                                    + " ".join(argv if argv is not None else sys.argv[1:]),
                                    "chunk": args.chunk, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
