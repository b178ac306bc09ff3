"""The asyncio SDK against a real sidecar: many streams on one socket, the same outputs as the
sync SDK, typed errors, cancel and ownership, crossing an executor SIGKILL, and a dead sidecar."""
import asyncio
import os
import signal
import time

import pytest

from kvhold.client.aclient import AsyncClient
from kvhold.client.client import wait_all
from kvhold.protocol.errors import InvalidParams, NotFound, PromptTooLong, SidecarUnavailable
from kvhold.testing.sidecar_process import SidecarProcess
from tests.process.helpers import wait_stopped

REQUESTS = [dict(prompt=f"Request number {i} about the sidecar", max_tokens=24 + i % 5,
                 temperature=0.0 if i % 3 == 0 else 0.9, seed=100 + i) for i in range(12)]


@pytest.fixture(scope="module")
def sidecar_flags(tiny_model):
    return ["--model", str(tiny_model), "--max-seq-len", "256"]      # with a standby


@pytest.fixture(scope="module")
def reference(sidecar):
    with sidecar.new_client(timeout=30) as client:
        streams = [client.generate(r["prompt"], **{k: v for k, v in r.items() if k != "prompt"})
                   for r in REQUESTS]
        return [res.token_ids for res in wait_all(streams)]


def aclient(sc, **kw) -> AsyncClient:
    return AsyncClient.for_instance(sc.instance, sc.runtime_root, **kw)


async def _run_one(client, r, on_token=None):
    kwargs = {k: v for k, v in r.items() if k != "prompt"}
    stream = await client.generate(r["prompt"], **kwargs)
    events = []
    async for event in stream:
        events.append(event)
        if on_token is not None:
            on_token()
    result = await stream.result()
    assert [e.index for e in events] == list(range(len(events)))
    assert [e.token_id for e in events] == result.token_ids
    return result


def test_concurrent_streams_match_the_sync_sdk(sidecar, reference):
    async def main():
        async with aclient(sidecar, timeout=30) as client:
            results = await asyncio.gather(*(_run_one(client, r) for r in REQUESTS))
            status = await client.status()
            generation = await client.ping()
        return results, status, generation

    results, status, generation = asyncio.run(main())
    assert [r.token_ids for r in results] == reference
    assert all(r.finish_reason in ("length", "stop") and r.prompt_tokens > 0 for r in results)
    assert status["generation"] == generation


def test_hundreds_of_one_token_requests_all_get_their_stream(sidecar):
    """A short request's Done can arrive before generate() resumes after its Accepted: the
    stream must still be there, finished, with its one or two tokens."""
    async def main():
        in_flight = asyncio.Semaphore(128)      # under the sidecar's 256 request slots
        async with aclient(sidecar, timeout=30) as client:
            async def one(i):
                async with in_flight:
                    stream = await client.generate(f"short {i}", max_tokens=1 + i % 2, seed=i)
                    return await stream.result()
            return await asyncio.gather(*(one(i) for i in range(300)))

    results = asyncio.run(main())
    assert len(results) == 300
    assert [len(r.token_ids) for r in results] == [1 + i % 2 for i in range(300)]


def test_typed_errors_and_the_client_keeps_working(sidecar):
    async def main():
        async with aclient(sidecar) as client:
            with pytest.raises(InvalidParams):
                await client.generate("hi", temperature=-1.0)           # fails fast, no round trip
            with pytest.raises(PromptTooLong):
                await client.generate(prompt_ids=list(range(2, 300)), max_tokens=5)
            with pytest.raises(ValueError):
                await client.generate("a", prompt_ids=[1])
            return await (await client.generate("still here", max_tokens=3, ignore_eos=True)).result()

    assert asyncio.run(main()).completion_tokens == 3


def test_cancel_and_ownership(tiny_model, start_sidecar, tmp_path):
    # The executor stops itself at its 5th commit, a few tokens into the 200 (ignore_eos: no early
    # end): the request is certainly running when the cancels arrive, as in the sync SDK's test.
    sc = start_sidecar(["--model", str(tiny_model), "--max-seq-len", "256", "--standbys", "0",
                        "--lease-ms", "60000"],
                       env={"KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")})
    pid = sc.wait_steady(standbys=0)["pid"]

    async def main():
        async with aclient(sc) as client, aclient(sc) as other:
            stream = await client.generate("A long answer", max_tokens=200, temperature=0.0, ignore_eos=True)
            await stream.__anext__()
            wait_stopped(pid)
            try:
                with pytest.raises(NotFound):          # not theirs: it does not exist for them
                    await other.cancel(stream.request_id)
                await stream.cancel()
            finally:
                os.kill(pid, signal.SIGCONT)
            return await stream.result()

    result = asyncio.run(main())
    assert result.finish_reason == "cancelled" and result.completion_tokens < 200


def test_streams_cross_an_executor_sigkill(sidecar, reference):
    seen = [0]
    active = sidecar.wait_steady()

    def on_token():
        seen[0] += 1
        if seen[0] == 40:
            os.kill(active["pid"], signal.SIGKILL)

    async def main():
        async with aclient(sidecar, timeout=30) as client:
            return await asyncio.gather(*(_run_one(client, r, on_token) for r in REQUESTS))

    results = asyncio.run(main())
    assert seen[0] >= 40
    assert [r.token_ids for r in results] == reference
    assert sidecar.wait_for(lambda st: [e for e in sidecar.executors(st, "active") if e["pid"] != active["pid"]],
                            timeout=60)


def test_a_dead_sidecar_is_an_error_in_bounded_time(tiny_model, tmp_path):
    # the executor stops itself at its 5th commit: the stream cannot end before the sidecar's death,
    # however slowly this test reads its first token
    env = {"KVHOLD_FAULT": "commit_finish:5:stop", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    with SidecarProcess(["--model", str(tiny_model), "--standbys", "0", "--lease-ms", "30000"], env=env) as sc:
        sc.wait_steady(standbys=0)

        async def main():
            client = aclient(sc, timeout=2.0)
            stream = await client.generate("Going", max_tokens=400, temperature=0.0)
            await stream.__anext__()
            sc.stop(signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(SidecarUnavailable):
                async for _ in stream:
                    pass
            elapsed = time.monotonic() - t0
            with pytest.raises(SidecarUnavailable):
                await client.ping()
            await client.close()
            return elapsed

        assert asyncio.run(main()) < 5
