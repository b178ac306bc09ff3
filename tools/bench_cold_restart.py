"""Baseline without kvhold: a crashed engine restarted cold.

    python -m tools.bench_cold_restart --model DIR --device cuda:0 --requests 64 --prompt-len 512,2048

A new process does what an engine restart does today: import torch, create its
CUDA context, load the safetensors onto the GPU, allocate its KV cache, capture
graphs, then re-prefill every in-flight request (prompt plus the tokens already
generated) before it can emit the next token. The parent records the spawn time;
the child reports each phase on CLOCK_MONOTONIC. Writes JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t = {"start": time.monotonic()}
import torch
t["torch_imported"] = time.monotonic()
torch.zeros(1, device=sys.argv[2]); torch.cuda.synchronize()
t["context"] = time.monotonic()
from pathlib import Path
from tools.bench_engine_setup import admit, build_engine
from tools.bench_recovery import make_requests
cfg = json.loads(Path(sys.argv[1], "config.json").read_text())
lo, hi = (int(x) for x in sys.argv[4].split(","))
reqs = make_requests(int(sys.argv[3]), (lo, hi), int(sys.argv[5]), cfg["vocab_size"], 0)
done = int(sys.argv[5]) // 2          # each request had generated half its tokens when the crash came
for r in reqs:
    r["prompt_ids"] = r["prompt_ids"] + [5] * done
engine, tables = build_engine(Path(sys.argv[1]), sys.argv[2], int(sys.argv[6]), int(sys.argv[7]), 64, int(sys.argv[8]), 512,
                              timeline=t)
admit(tables, reqs)
n = 0
while engine.tokens_generated < len(reqs):
    engine.step(); n += 1
    if n == 1:          # the first step apart: in a cold process it also compiles what it launches first
        torch.cuda.synchronize()
        t["first_step"] = time.monotonic()
torch.cuda.synchronize()
t["first_token_all"] = time.monotonic()
t["steps"] = n
tables.unlink()
t["tokens_reprefilled"] = sum(len(r["prompt_ids"]) for r in reqs)
print(json.dumps(t))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", default="512,2048")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--kv-pages", type=int, default=16384,
                   help="the restarted engine's KV cache in 16-token pages (default 16384: 32 GiB at Llama-3-8B)")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=Path("bench/results/cold_restart_cuda.json"))
    args = p.parse_args(argv)
    runs = []
    for _ in range(args.runs):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", CHILD, str(args.model), args.device, str(args.requests),
                              args.prompt_len, str(args.max_tokens), str(args.kv_pages), str(args.max_seq_len),
                              str(args.max_batch_tokens)], capture_output=True, text=True)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            return 1
        t = json.loads(out.stdout.strip().splitlines()[-1])
        phases = {k: (v - t0) * 1e3 for k, v in t.items() if k not in ("tokens_reprefilled", "steps")}
        runs.append({"ms_from_spawn": phases, "tokens_reprefilled": t["tokens_reprefilled"], "steps": t["steps"]})
        print(" ".join(f"{k}={v:.0f}ms" for k, v in phases.items()), flush=True)
    result = {"command": "python -m tools.bench_cold_restart " + " ".join(argv or sys.argv[1:]), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
