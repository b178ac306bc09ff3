"""Where a new executor's start goes on CUDA, op by op, in a fresh process.

    python -m tools.probe_executor_start --vocab 128256 --rows 64 --out bench/results/executor_start_cuda.json

A zygote's child starts with torch imported and no CUDA context; everything it runs
for the first time then costs a module load (lazy loading) on top of the work. This
probe times, in a process that has just imported torch: the context, then each of the
sampler's operations at a decode step's shape (first call, then a second call), so that
the warm-up can be cut to what a takeover's first step needs.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    t_import = time.monotonic()
    import torch

    from kvhold.executor.sampler import sample
    from kvhold.executor.sequence import Sequence
    from kvhold.protocol.sampling import SamplingParams

    out = {"command": " ".join(["python -m tools.probe_executor_start", *(argv or sys.argv[1:])]),
           "import_ms": round((time.monotonic() - t_import) * 1e3, 1), "ops": []}
    dev = torch.device(args.device)

    def timed(name, fn):
        for call in ("first", "second"):
            torch.cuda.synchronize(dev) if torch.cuda.is_initialized() else None
            t0 = time.monotonic()
            fn()
            torch.cuda.synchronize(dev)
            out["ops"].append({"op": name, "call": call, "ms": round((time.monotonic() - t0) * 1e3, 2)})

    t0 = time.monotonic()
    torch.cuda.init()
    torch.cuda.set_device(dev)
    torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    out["context_ms"] = round((time.monotonic() - t0) * 1e3, 1)
    logits = torch.empty(args.rows, args.vocab, device=dev)
    timed("randn", lambda: logits.normal_())
    timed("argmax", lambda: torch.argmax(logits, dim=-1))
    timed("float", lambda: logits.float() * 1.0)
    timed("sort", lambda: torch.sort(logits, dim=-1, descending=True, stable=True))
    timed("softmax", lambda: torch.softmax(logits, dim=-1))
    timed("cumsum", lambda: torch.cumsum(logits, dim=-1))
    timed("masked_fill", lambda: logits.masked_fill(logits > 0, 0.0))
    timed("sum", lambda: (logits > 0).sum(dim=-1))
    cdf = torch.cumsum(torch.softmax(logits, -1), -1)
    u = torch.rand(args.rows, 1, device=dev)
    timed("searchsorted", lambda: torch.searchsorted(cdf, u, right=True))
    order = torch.argsort(logits, dim=-1)
    timed("gather", lambda: order.gather(1, torch.zeros(args.rows, 1, dtype=torch.long, device=dev)))
    timed("tolist", lambda: torch.argmax(logits, dim=-1).tolist())
    seqs = [Sequence(slot=-1, request_id=0, prompt_len=1, tokens=[0], sampling=SamplingParams(
                max_tokens=1, seed=i, temperature=0.8, top_p=0.9, top_k=40, ignore_eos=True)) for i in range(args.rows)]
    timed("sample_sampled_rows", lambda: sample(logits, seqs, pad_rows=args.rows))
    out["first_calls_ms"] = round(sum(o["ms"] for o in out["ops"] if o["call"] == "first"), 1)
    out["second_calls_ms"] = round(sum(o["ms"] for o in out["ops"] if o["call"] == "second"), 1)
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
