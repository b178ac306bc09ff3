"""Probe: can a process with no CUDA context keep device memory alive for others?

    python -m tools.gpu_probe_vmm [--size-mb 1024]

Acts as a sidecar: cuInit + cuMemCreate (POSIX-fd handle) + export, and checks it
never created a context. Then a first importer (torch) maps the memory, fills it
with a pattern, reports its checksum and is SIGKILLed mid-loop; a second importer
maps the same memory and checks the bytes survived. Prints one JSON object with
timings (export, import+map) and the verdicts; exit code 0 only if all hold.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time, torch
from kvhold.protocol.memory import CudaMapping, RegionInfo
fd, size, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t0 = time.monotonic()
m = CudaMapping(fd, RegionInfo("probe", size, "cuda", False, 0, 0))
t_map = time.monotonic() - t0
buf = m.tensor(torch.int32, (size // 4,))
if mode == "write":
    buf.copy_(torch.arange(size // 4, dtype=torch.int32, device=buf.device) * 7 + 3)
    torch.cuda.synchronize()
    print(json.dumps({"map_ms": t_map * 1e3, "sum": int(buf.sum().item())}), flush=True)
    while True:                              # keep the GPU busy until we are killed
        buf.add_(0)
else:
    want = torch.arange(size // 4, dtype=torch.int32, device=buf.device) * 7 + 3
    print(json.dumps({"map_ms": t_map * 1e3, "sum": int(buf.sum().item()),
                      "intact": bool(torch.equal(buf, want))}), flush=True)
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--device", type=int, default=0)
    args = p.parse_args(argv)
    from kvhold.protocol import cuda_vmm

    t0 = time.monotonic()
    alloc = cuda_vmm.VmmAllocation(args.size_mb << 20, args.device)
    fd = alloc.export_fd()
    create_ms = (time.monotonic() - t0) * 1e3
    no_context = not cuda_vmm.has_current_context()
    env = dict(os.environ)
    writer = subprocess.Popen([sys.executable, "-c", CHILD, str(fd), str(alloc.size), "write"],
                              pass_fds=[fd], stdout=subprocess.PIPE, text=True, env=env)
    first = json.loads(writer.stdout.readline())
    t_kill = time.monotonic()
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    exit_ms = (time.monotonic() - t_kill) * 1e3
    reader = subprocess.run([sys.executable, "-c", CHILD, str(fd), str(alloc.size), "read"],
                            pass_fds=[fd], capture_output=True, text=True, env=env)
    second = json.loads(reader.stdout.strip().splitlines()[-1]) if reader.returncode == 0 else {
        "error": reader.stderr[-2000:]}
    result = {"size_mb": args.size_mb, "sidecar_has_no_context": no_context,
              "create_export_ms": create_ms, "writer": first, "writer_kill_to_exit_ms": exit_ms,
              "reader": second, "sidecar_still_has_no_context": not cuda_vmm.has_current_context(),
              "memory_survived_importer_kill": second.get("intact") is True
              and second.get("sum") == first["sum"]}
    print(json.dumps(result, indent=1))
    ok = result["sidecar_has_no_context"] and result["sidecar_still_has_no_context"] and \
        result["memory_survived_importer_kill"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
