"""Helpers shared by the process tests: the recovery workload (flags, requests, how to
submit them and compare outputs), the long workloads of the pool-restart and re-adoption
tests, `kvhold serve` as these tests start it, the query of death, a bounded poll, a free
port, a sidecar's log and its shared memory as the executors see it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from kvhold.testing.etcd_process import free_port  # noqa: F401 (re-exported for the tests)
from kvhold.testing.serve_process import Events, ServeProcess, comparable, http_client  # noqa: F401 (re-exported)
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests

DATA = Path(__file__).resolve().parents[1] / "data"     # tests/data: recordings, AOT fixtures

FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
         "--log-level", "INFO"]
LONG_PROMPT = list(range(2, 202))       # 200 tokens: a prefill of several 64-token chunks
REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=40, temperature=0.0),
    dict(prompt="Once upon a time", max_tokens=40, temperature=0.8, seed=7),
    dict(prompt_ids=LONG_PROMPT, max_tokens=30, temperature=1.0, top_p=0.9, seed=3),
    dict(prompt="One two three four", max_tokens=40, temperature=0.7, top_k=20, seed=11),
    dict(prompt="Never lose a stream", max_tokens=35, temperature=1.1, seed=5),
]


def submit(client, requests=REQUESTS):
    return submit_requests(client, requests)


def ids(results):
    return [r.token_ids for r in results]


def run_with_fault(start_sidecar, flags, tmp_path: Path, fault: str, requests=REQUESTS, outcome=ids):
    """`requests` on a sidecar started with `flags` whose executor dies once at `fault` (a
    kvhold.executor.faults spec): (`outcome` of their results, the sidecar's recoveries)."""
    from kvhold.client.client import wait_all

    env = {"KVHOLD_FAULT": fault, "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(list(flags), env=env)
    sc.wait_steady()
    with sc.new_client(timeout=60) as client:
        got = outcome(wait_all(submit(client, requests)))
    assert (tmp_path / "fired").exists()
    return got, fault_recoveries(sc.status())


def fault_recoveries(status: dict) -> list[dict]:
    """The recovery records of a sidecar's status but those of hang fences: on a loaded machine
    an executor's heartbeat lease can lapse (a false hang, fenced and taken over like any);
    the recoveries an injected death caused are the others."""
    hung = {e["fenced_epoch"] for e in status["events"] if e["kind"] == "fence" and e.get("reason") == "hang"}
    return [r for r in status["recoveries"] if r.get("fenced_epoch") not in hung]


def wait_until(cond, timeout_s: float = 10.0, interval_s: float = 0.01, what: str = "condition"):
    """Poll `cond()` until it returns something truthy (returned), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)
    return value


def unique_prompt_token(model_dir, requests, index: int) -> int:
    """A token id of request `index`'s prompt (text, tokenized as the frontend does, or ids) that
    no other request's prompt holds: the fault point `step:token=<id>@<n>` then counts the steps of
    that one request."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))

    def prompt(r):
        return set(r["prompt_ids"]) if "prompt_ids" in r else set(tokenizer.encode(r["prompt"]).ids)
    others = set().union(*(prompt(r) for i, r in enumerate(requests) if i != index))
    return max(prompt(requests[index]) - others)


def wait_decoding(tables, rids: list[int], generated: int, timeout_s: float = 60.0) -> None:
    """Until every request of `rids` has `generated` tokens in the journal, read from its
    execution half only while that half is the request's own (not a slot's last occupant's)."""
    import numpy as np

    req = tables.requests

    def decoding():
        slots = [np.flatnonzero(req["request_id"] == rid) for rid in rids]
        return all(len(s) and req["exec_request_id"][s[0]] == rid and req["num_generated"][s[0]] >= generated
                   for s, rid in zip(slots, rids))
    wait_until(decoding, timeout_s, what="the requests to decode")


def wait_stopped(pid: int, timeout_s: float = 20.0) -> None:
    """Until `pid` is in the stopped state (after SIGSTOP), as /proc shows it."""
    wait_until(lambda: open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "T",
               timeout_s, what=f"pid {pid} to stop")


def stop_at_step(tmp_path: Path, token: int, step: int) -> tuple[Path, dict]:
    """A fault that stops the executor (SIGSTOP of itself) at the `step`-th step of a request whose
    prompt holds `token`, once, and only after the returned path exists (touch it to arm):
    (that path, the sidecar's environment)."""
    armed = tmp_path / "armed"
    return armed, {"KVHOLD_FAULT": f"step:token={token}@{step}:stop", "KVHOLD_FAULT_IF": str(armed),
                   "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}


def greedy_across_a_kill(sc: SidecarProcess, client, armed: Path, prompt: list[int], max_tokens: int):
    """Arm a `stop_at_step` fault, stream a greedy request of `prompt`, SIGKILL the active executor
    once the fault has stopped it, and read the stream to its end: (the tokens the client saw,
    the sidecar's record of the recovery). The standby has taken over by then."""
    active = sc.wait_steady()["pid"]
    armed.touch()
    stream = client.generate(prompt_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    wait_stopped(active, 60)
    os.kill(active, signal.SIGKILL)
    os.kill(active, signal.SIGCONT)
    seen = [event.token_id for event in stream]
    assert sc.wait_steady()["pid"] != active
    return seen, sc.wait_for(lambda st: st["recoveries"] and st["recoveries"][-1], 30)


def sidecar_log(sc: SidecarProcess) -> str:
    return sc.log_path.read_text() if sc.log_path and sc.log_path.exists() else ""


def alive(pid: int) -> bool:
    """`pid` runs (exists and is no zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"


def roles(status) -> dict[int, str]:
    return {e["pid"]: e["role"] for e in status["executors"]}


def attach_pool(sc: SidecarProcess):
    """The sidecar's tables and KV pages (as uint32 words), mapped as an executor maps them."""
    import numpy as np
    import posix_ipc

    from kvhold.protocol.memory import Mapping, RegionInfo
    from kvhold.protocol.tables import Tables

    uid = os.getuid()
    tables = Tables.attach_name(f"/kvhold-{uid}-{sc.instance}-tables")
    shm = posix_ipc.SharedMemory(f"/kvhold-{uid}-{sc.instance}-kv")
    g = tables.geometry
    kv = Mapping.from_fd(shm.fd, RegionInfo("kv", g.kv_pool_bytes, "host", False))
    shm.close_fd()
    words = kv.numpy(np.uint32, (g.num_pages, g.kv.num_layers, 2, g.kv.page_tokens, g.kv.row_bytes // 4))
    return tables, words


# ---------------------------------------------------------------- long workloads
# the re-adoption tests: long enough to be mid-stream at the kill; greedy and seeded sampling
READOPT_FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16",
                 "--standbys", "1", "--log-level", "INFO"]
READOPT_REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=300, temperature=0.0, ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=320, temperature=0.0, ignore_eos=True),
    dict(prompt_ids=list(range(2, 90)), max_tokens=280, temperature=0.9, seed=3, ignore_eos=True),
]

# the pool-restart tests: long (ignore_eos), every one is still running when the drain starts
POOL_RESTART_FLAGS = ["--kv-pages", "256", "--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch",
                      "16", "--standbys", "0", "--log-level", "INFO"]
POOL_RESTART_REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=400, temperature=0.0, ignore_eos=True),
    dict(prompt="Once upon a time", max_tokens=420, temperature=0.8, seed=7, ignore_eos=True),
    dict(prompt_ids=list(range(2, 90)), max_tokens=380, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True),
    dict(prompt="One two three four", max_tokens=410, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
]


def pool_restart_cmd(instance, runtime_root, *args) -> list[str]:
    return [sys.executable, "-m", "kvhold", "pool-restart", "--instance", instance,
            "--runtime-root", str(runtime_root), *args]


def pool_restart_cli(instance, runtime_root, *args, timeout=90):
    return subprocess.run(pool_restart_cmd(instance, runtime_root, *args),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- the query of death
BAD_TOKEN = 3       # the fault `step:token=3:segv` kills every executor whose step holds it
# a prompt of 400 tokens: prefilled in 9 chunks, so the bad request's prefill shares a step with
# one of them, and after that death both re-run the step at the same point (the isolation test)
GOOD = dict(prompt_ids=list(range(10, 410)), max_tokens=40, temperature=0.8, seed=9)
BAD = dict(prompt_ids=[5, 6, BAD_TOKEN, 8, 9], max_tokens=10, temperature=0.0)


# ---------------------------------------------------------------- kvhold serve
KEY = "sk-test-kvhold"
MAX_SEQ = 512
# a lease that tolerates CPU starvation when suites run side by side
SERVE_FLAGS = ["--max-seq-len", str(MAX_SEQ), "--log-level", "WARNING", "--lease-ms", "3000"]


class Server(ServeProcess):
    """`kvhold serve` of `model` with SERVE_FLAGS, then `flags`, healthy on return: with a
    standby ready, or none when `flags` set --standbys."""

    def __init__(self, model, runtime_root, log_path, *flags, api_key=None, env=None):
        super().__init__([*SERVE_FLAGS, *flags], runtime_root, model=model, log_path=log_path, api_key=api_key,
                         env=env)
        self.start(standbys=0 if "--standbys" in flags else 1)


def completion(srv: ServeProcess, **kw):
    return srv.openai().completions.create(model="tiny-v1", **kw)


def http_child(srv: ServeProcess) -> int:
    """The pid of the supervisor's `kvhold serve-http` child."""
    return wait_until(lambda: srv.child("serve-http"), 30, 0.05, what="the HTTP server process")


def stream_request_id(srv: ServeProcess, event_id: str) -> int:
    """The sidecar's request id behind a resumable HTTP stream (its record in the runtime
    directory, kvhold.serving.stream_resume), from one of its event ids."""
    from kvhold.protocol.naming import InstancePaths

    record = InstancePaths.for_instance(srv.instance, srv.runtime_root).runtime_dir / "http-streams"
    return json.loads((record / f"{event_id.split('-')[0]}.json").read_text())["request_id"]


def whole(srv: ServeProcess, path: str, body: dict) -> list:
    """Every event of a streamed POST, read to its end."""
    with http_client().stream("POST", srv.base + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        return Events(r).read().events
