"""The client-facing frontend as its own failure domain: `kvhold sidecar --external-frontend`
owns the memory and the executors and parses no client input; `kvhold frontend` serves the
clients. A SIGKILL of the frontend mid-stream (alone, and under `kvhold serve`) leaves the
memory owner, its executors and its weights as they were: a new frontend adopts the
requests from the shm journal, the SDK resumes its stream and the HTTP client's stream only
pauses, and both end with the text of an uninterrupted run, nothing recomputed."""
import json
import os
import signal
import time

import pytest

from kvhold.testing.split_process import SplitProcesses
from kvhold.testing.serve_process import http_client
from tests.process.helpers import BAD, BAD_TOKEN, FLAGS, GOOD, Events, Server, comparable, wait_until, whole

PROMPT = dict(prompt="The sidecar keeps the memory", max_tokens=120, temperature=0.0, ignore_eos=True)
SAMPLED = dict(prompt="Once upon a time", max_tokens=100, temperature=0.9, seed=7, ignore_eos=True)


def executor_pids(status) -> dict:
    return {e["pid"]: e["role"] for e in status["executors"]}


def owner_state(status) -> tuple:
    """What a frontend's death must not change: the owner, its executors, its weights."""
    return (status["pid"], executor_pids(status), status["weights"]["load_ms"],
            status["weights"]["fingerprint"], status["generation"])


@pytest.fixture
def split(tiny_model, runtime_root, tmp_path):
    sp = SplitProcesses(["--model", str(tiny_model), *FLAGS, "--lease-ms", "3000"], runtime_root=runtime_root,
                        log_dir=tmp_path)
    sp.start()
    yield sp
    sp.stop()


def _steady(sp: SplitProcesses) -> dict:
    return wait_until(lambda: (st := sp.status()) and sorted(executor_pids(st).values()) == ["active", "standby"]
                      and st, 60, 0.1, what="an active and a standby executor")


def _check_owner_imports_no_client_facing_code(sp: SplitProcesses, status: dict) -> None:
    """What the memory owner says it imported, and what its address space holds."""
    assert status["memory_owner"]["client_facing_modules"] == []
    maps = open(f"/proc/{sp.owner.pid}/maps").read()
    assert "tokenizers" not in maps                 # no tokenizer library mapped either
    assert "libcuda" not in maps                    # and no CUDA context, as ever
    # the frontend is the one that has them
    assert "tokenizers" in open(f"/proc/{sp.frontend.pid}/maps").read()


def test_sigkill_of_the_frontend_mid_stream(split, tiny_model):
    before = _steady(split)
    _check_owner_imports_no_client_facing_code(split, before)
    with split.new_client() as client:
        reference = [client.generate(**PROMPT).result(), client.generate(**SAMPLED).result()]
    with split.new_client() as client:
        streams = [client.generate(**PROMPT), client.generate(**SAMPLED)]
        first = [next(streams[0]) for _ in range(8)]
        os.kill(split.frontend.pid, signal.SIGKILL)       # the frontend alone, mid-stream
        split.frontend.wait()
        killed_at = time.monotonic()
        during = split.owner.poll()
        split.start_frontend()
        results = [s.result() for s in streams]
    assert during is None
    for got, want in zip(results, reference):
        assert got.token_ids == want.token_ids and got.text == want.text
        assert got.finish_reason == want.finish_reason and got.recomputed_tokens == 0
    assert [e.token_id for e in first] == reference[0].token_ids[:8]
    after = split.wait_serving()
    assert owner_state(after) == owner_state(before)     # same owner, executors, weights, pool
    assert after["recoveries"] == [] and after["adoption"] is None     # no takeover, no re-adoption
    assert after["memory_owner"]["frontend"]["sessions"] == 2
    _check_owner_imports_no_client_facing_code(split, after)
    assert after["pool_restart"]["restore"]["requests_adopted"] == 2
    assert after["requests"]["in_flight"] == 0
    assert time.monotonic() - killed_at < 30


@pytest.mark.slow
def test_a_request_that_ends_while_no_frontend_runs_is_kept_for_its_client(split):
    _steady(split)
    with split.new_client() as client:
        reference = client.generate(**dict(PROMPT, max_tokens=30)).result()
    with split.new_client() as client:
        stream = client.generate(**dict(PROMPT, max_tokens=30))
        next(stream)
        os.kill(split.frontend.pid, signal.SIGKILL)
        split.frontend.wait()
        # the executors finish it meanwhile: its slot waits for a frontend to hand the result over
        time.sleep(2.0)
        split.start_frontend()
        got = stream.result()
    assert got.token_ids == reference.token_ids and got.text == reference.text


@pytest.mark.slow
def test_a_stop_journals_the_in_flight_requests_through_the_frontend(tiny_model, runtime_root, tmp_path):
    """SIGTERM of the owner: its executors stop, the frontend writes each request with its
    committed tokens to the durable journal, and the next start (owner + frontend) restores it."""
    flags = ["--model", str(tiny_model), *FLAGS, "--lease-ms", "3000"]
    sp = SplitProcesses(flags, runtime_root=runtime_root, log_dir=tmp_path).start()
    try:
        _steady(sp)
        with sp.new_client() as client:
            reference = client.generate(**dict(PROMPT, max_tokens=200)).result()
        client = sp.new_client()
        stream = client.generate(**dict(PROMPT, max_tokens=200))
        head = [next(stream).token_id for _ in range(5)]
        codes = sp.stop()
        assert codes == (0, 0)
        assert "in-flight requests journaled" in (tmp_path / "frontend-1.log").read_text()
        sp2 = SplitProcesses(flags, instance=sp.instance, runtime_root=runtime_root, log_dir=tmp_path).start()
        try:
            got = stream.result()
            assert head == reference.token_ids[:5]
            assert got.token_ids == reference.token_ids and got.text == reference.text
            status = sp2.status()
            assert status["memory_owner"]["restore"]["requests_restored"] == 1
        finally:
            client.close()
            sp2.stop()
    finally:
        sp.stop()


@pytest.mark.slow
def test_sigkill_of_the_frontend_mid_stream_under_serve(tiny_model, tmp_path, runtime_root):
    """`kvhold serve` restarts its frontend: an SDK stream and an HTTP stream started before the
    kill both end as in an uninterrupted run; executors, weights and the memory owner stay."""
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--max-seq-len", "1024")
    try:
        body = {"prompt": "The sidecar keeps the memory", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        reference = whole(srv, "/v1/completions", body)
        from kvhold.client.client import Client
        # the SDK stream starts first and must still run at the kill: 900 tokens, well past the
        # HTTP stream's fifth (a Done the killed frontend had queued and not yet sent is lost)
        sampled = dict(SAMPLED, max_tokens=900)
        with Client.for_instance(srv.instance, srv.runtime_root, timeout=10) as client:
            sdk_reference = client.generate(**sampled).result()
        before = srv.sidecar_status()
        frontend_pid = before["frontend"]["pid"]
        with Client.for_instance(srv.instance, srv.runtime_root, timeout=10) as client:
            sdk = client.generate(**sampled)
            next(sdk)
            with http_client().stream("POST", srv.base + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                events = Events(r).read(5)
                os.kill(frontend_pid, signal.SIGKILL)
                events.read()
            sdk_got = sdk.result()
        got = events.events
        assert got[-1] == (None, "[DONE]") and comparable(got) == comparable(reference)
        assert json.loads(got[-2][1])["usage"]["completion_tokens"] == 200
        assert sdk_got.token_ids == sdk_reference.token_ids and sdk_got.text == sdk_reference.text
        assert sdk_got.recomputed_tokens == 0
        after = srv.sidecar_status()
        assert after["frontend"]["pid"] != frontend_pid
        assert owner_state(after) == owner_state(before)
        assert after["recoveries"] == [] and after["memory_owner"]["client_facing_modules"] == []
        log = (tmp_path / "serve.log").read_text()
        assert f"the frontend pid {frontend_pid} was killed by SIGKILL after" in log
        assert srv.wait_healthy(timeout=60)["status"] == "ok"
    finally:
        srv.stop()
    assert srv.proc.returncode == 0


@pytest.mark.slow
def test_a_request_that_kills_its_executors_is_failed_through_the_link(tiny_model, runtime_root, tmp_path):
    """The query-of-death rule stays with the memory owner: it counts the deaths, cancels the
    request in the journal and tells the frontend, whose client gets REQUEST_FAILED; the
    request batched with it completes as in an uninterrupted run."""
    from kvhold.protocol.errors import RequestFailed

    sp = SplitProcesses(["--model", str(tiny_model), *FLAGS], runtime_root=runtime_root, log_dir=tmp_path,
                        env={"KVHOLD_FAULT": f"step:token={BAD_TOKEN}:segv"}).start()
    try:
        _steady(sp)
        with sp.new_client(timeout=60) as client:
            reference = client.generate(**GOOD).result().token_ids
            good, bad = client.generate(**GOOD), client.generate(**BAD)
            with pytest.raises(RequestFailed) as failure:
                bad.result()
            assert good.result().token_ids == reference
        assert "died 2 times" in str(failure.value)
        status = wait_until(lambda: (st := sp.status())["requests"]["in_flight"] == 0 and st, 30, 0.1,
                            what="the failed request's slot released")
        assert status["request_deaths"]["failed_total"] == 1
        assert status["requests"]["finished"].get("failed") == 1
        assert status["memory_owner"]["frontend"]["failed_pending"] == 0
    finally:
        sp.stop()


@pytest.mark.slow
def test_a_request_failed_while_no_frontend_runs_is_failed_for_its_client(tiny_model, runtime_root, tmp_path):
    """The owner keeps the requests it failed while their slots hold them; the next frontend
    learns of them in its hello and the client that resumes gets REQUEST_FAILED."""
    from kvhold.protocol.errors import RequestFailed

    sp = SplitProcesses(["--model", str(tiny_model), *FLAGS], runtime_root=runtime_root, log_dir=tmp_path,
                        env={"KVHOLD_FAULT": f"step:token={BAD_TOKEN}:segv"}).start()
    try:
        _steady(sp)
        with sp.new_client(timeout=90) as client:
            reference = client.generate(**GOOD).result().token_ids
            good, bad = client.generate(**GOOD), client.generate(**BAD)
            os.kill(sp.frontend.pid, signal.SIGKILL)
            sp.frontend.wait()
            wait_until(lambda: "died 2 times" in (tmp_path / "owner.log").read_text(), 90, 0.2,
                       what="the owner to fail the request")
            sp.start_frontend()
            with pytest.raises(RequestFailed, match="died 2 times"):
                bad.result()
            assert good.result().token_ids == reference
        status = wait_until(lambda: (st := sp.status())["requests"]["in_flight"] == 0 and st, 30, 0.1,
                            what="the failed request's slot released")
        assert status["request_deaths"]["failed_total"] == 1
        assert status["memory_owner"]["frontend"]["failed_pending"] == 0
    finally:
        sp.stop()


@pytest.mark.slow
def test_the_frontends_stats_line_counts_the_owners_recoveries(tiny_model, runtime_root, tmp_path):
    """An executor SIGKILLed mid-stream: the takeover is the memory owner's, and the stats line
    the frontend process logs counts it."""
    sp = SplitProcesses(["--model", str(tiny_model), *FLAGS, "--lease-ms", "3000", "--stats-interval", "1"],
                        runtime_root=runtime_root, log_dir=tmp_path)
    sp.start()
    try:
        active = next(p for p, r in executor_pids(_steady(sp)).items() if r == "active")
        with sp.new_client() as client:
            stream = client.generate(**dict(PROMPT, max_tokens=300))
            for _ in range(5):
                next(stream)
            os.kill(active, signal.SIGKILL)
            stream.result()
        assert len(sp.status()["recoveries"]) == 1
        log_path = tmp_path / "frontend-1.log"
        # a stats line after the takeover's first step (one a second): waited for, not slept on
        wait_until(lambda: ", recoveries 1" in log_path.read_text(), 30, what="a stats line counting the recovery")
        log = log_path.read_text()
        assert "generation throughput" in log and ", recoveries 1" in log, log[-3000:]
    finally:
        sp.stop()


@pytest.mark.slow
def test_a_request_the_frontend_died_with_unanswered_is_failed_for_sending_again(split):
    """A Generate the frontend took (stopped, then SIGKILLed) and never answered: once the SDK's
    socket connects to the next frontend it fails that request with SidecarUnavailable (an HTTP
    client gets 503 and Retry-After), instead of waiting while other streams' traffic keeps its
    silence timeout from firing; the stream in flight meanwhile continues as ever."""
    import asyncio

    from kvhold.client.aclient import AsyncClient
    from kvhold.protocol.errors import SidecarUnavailable

    _steady(split)
    with split.new_client() as client:
        reference = client.generate(**PROMPT).result()

    async def run():
        async with AsyncClient.for_instance(split.instance, split.runtime_root, timeout=120) as client:
            other = await client.generate(**PROMPT)
            events = [await other.__anext__()]
            os.kill(split.frontend.pid, signal.SIGSTOP)      # it takes no message from here on
            lost = asyncio.ensure_future(client.generate(**SAMPLED))
            await asyncio.sleep(0)                          # the Generate is sent (its first step)
            os.kill(split.frontend.pid, signal.SIGKILL)
            split.frontend.wait()
            split.start_frontend()
            with pytest.raises(SidecarUnavailable, match="lost before it answered"):
                await asyncio.wait_for(lost, 60)            # not the 120 s silence timeout
            events += [e async for e in other]
            return events

    events = asyncio.run(run())
    assert [e.token_id for e in events] == reference.token_ids
