"""A CPU executor keeps large blocks in malloc's heap. A decode step's temporaries grow with
the context, so each is larger than any before it: glibc maps every such block afresh and
unmaps it at free, and each step faulted in and zeroed its pages anew."""
import resource
import subprocess
import sys

from kvhold.executor import host_compute

# a fresh process (malloc's state is per process) allocates, touches and frees blocks that grow
# by 4 pages a step from 1 MiB, as a sequence's gathered keys do, and prints the page faults of
# the last 40 steps
GROWING = """
import resource, sys
import numpy as np
from kvhold.executor import host_compute
if sys.argv[1] == "keep":
    assert host_compute.keep_large_blocks()
page = resource.getpagesize()
def step(i):
    a = np.empty((1 << 20) + 4 * page * i, dtype=np.uint8)
    a.fill(1)
    del a
for i in range(10):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(10, 50):
    step(i)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", GROWING, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


def test_growing_blocks_fault_only_their_new_pages():
    if not host_compute.keep_large_blocks():        # not glibc: nothing to keep
        return
    kept, mapped = _faults("keep"), _faults("default")
    steps, block_pages = 40, (1 << 20) // resource.getpagesize()
    assert kept <= steps * 8, kept                  # the 4 new pages a step, and a few more
    assert mapped >= steps * block_pages // 2, mapped   # glibc's default: the whole block, each step
