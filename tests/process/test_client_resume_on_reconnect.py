"""The SDKs re-attach their streams as soon as their socket connects to a restarted sidecar:
with the silence timer pushed out of reach, streams across a sidecar SIGKILL and restart
still finish, identical to an uninterrupted run. Real processes, real signals."""
import asyncio
import os
import signal
import threading

import pytest

import kvhold.client.client as client_module
import kvhold.client.core as core_module
from kvhold.client.aclient import AsyncClient
from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from tests.process.helpers import wait_until

FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
         "--standbys", "1", "--log-level", "INFO"]
REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=260, temperature=0.0, ignore_eos=True),
    dict(prompt_ids=list(range(2, 60)), max_tokens=240, temperature=0.9, seed=3, ignore_eos=True),
]


async def _async_streams(instance, root, started: threading.Event, reference, out: dict):
    async with AsyncClient.for_instance(instance, root, timeout=60) as client:
        streams = [await client.generate(**r) for r in REQUESTS]
        for s in streams:
            await s.__anext__()
        started.set()
        out["ids"] = [(await s.result()).token_ids for s in streams]
        out["reconnects"] = client._reconnect.reconnects


@pytest.mark.slow
def test_streams_resume_on_reconnect_without_the_silence_timer(tiny_model, runtime_root, tmp_path, monkeypatch):
    monkeypatch.setattr(core_module, "RESUME_AFTER_S", 3600.0)    # the fallback never fires (both SDKs)
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(tmp_path / "journal")]
    first = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "first.log").start()
    second = None
    try:
        first.wait_steady(standbys=1)
        with first.new_client(timeout=60) as c:
            reference = [r.token_ids for r in wait_all(submit_requests(c, REQUESTS))]
        client = first.new_client(timeout=60)
        streams = submit_requests(client, REQUESTS)
        for s in streams:
            next(s)
        started, out = threading.Event(), {}
        loop_thread = threading.Thread(target=lambda: asyncio.run(
            _async_streams(first.instance, runtime_root, started, reference, out)), daemon=True)
        loop_thread.start()
        assert started.wait(60)
        os.kill(first.proc.pid, signal.SIGKILL)        # the sidecar alone: its executors wait
        first.proc.wait()
        second = SidecarProcess(flags, instance=first.instance, runtime_root=runtime_root,
                                log_path=tmp_path / "second.log").start()
        results = wait_all(streams)
        assert [r.token_ids for r in results] == reference
        assert [r.recomputed_tokens for r in results] == [0] * len(REQUESTS)
        assert client._reconnect.reconnects >= 1
        client.close()
        loop_thread.join(60)
        assert out.get("ids") == reference and out["reconnects"] >= 1
        wait_until(lambda: second.status()["adoption"] is not None, what="the adoption record")
    finally:
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


@pytest.mark.parametrize("events", [["connected"], ["disconnected", "connected", "disconnected", "connected"]])
def test_only_a_handshake_after_a_disconnect_counts_as_a_reconnect(events):
    import struct

    import zmq

    codes = {"connected": zmq.EVENT_HANDSHAKE_SUCCEEDED, "disconnected": zmq.EVENT_DISCONNECTED}
    watch = client_module.ReconnectWatch()
    seen = [watch.seen([struct.pack("=hi", codes[e], 0), b"ipc://x"]) for e in events]
    assert seen == [e == "connected" and i > 0 for i, e in enumerate(events)]
    assert watch.reconnects == events.count("disconnected")
