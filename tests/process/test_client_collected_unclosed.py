"""A client that is never closed and is collected in a reference cycle does not hang its
process: its sockets are closed before its context ends (a context's own finalizer, run
first, waits for ever on the sockets still open)."""
import subprocess
import sys

import pytest

CODE = """
import asyncio, gc, sys, time, zmq
from kvhold.client.client import Client
from kvhold.client.aclient import AsyncClient
endpoint = sys.argv[1]
server = zmq.Context().socket(zmq.ROUTER)
server.bind(endpoint)
if sys.argv[2] == "sync":
    c = Client(endpoint, timeout=1.0)
    c._cycle = c
    time.sleep(0.2)
else:
    async def make():
        c = AsyncClient(endpoint, timeout=1.0)
        c._cycle = c
        await asyncio.sleep(0.2)
    asyncio.run(make())
    c = None
server.close(0)
del c
gc.collect()
print("collected")
"""


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_unclosed_client_in_a_cycle_is_collected_without_hanging(kind, tmp_path):
    out = subprocess.run([sys.executable, "-c", CODE, f"ipc://{tmp_path}/s.sock", kind],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert "collected" in out.stdout
