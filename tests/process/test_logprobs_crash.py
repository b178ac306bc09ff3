"""Log-probs across executor crashes, with real processes and signals: the active executor is
SIGKILLed mid-stream (aimed from the shared tables' state: during a long prompt's prefill, and
after a chosen number of committed tokens), or dies between two stages of a commit; every
request's tokens, log-probs and prompt log-probs equal an uninterrupted run's."""
import os
import signal

import numpy as np
import pytest

from kvhold.client.client import wait_all
from kvhold.protocol.tables import Tables
from kvhold.testing.sidecar_process import SidecarProcess
from tests.process.helpers import (FLAGS, LONG_PROMPT, REQUESTS, run_with_fault, submit, unique_prompt_token,
                                   wait_stopped, wait_until)

LP_FLAGS = [*FLAGS, "--max-logprobs", "4"]
LP_REQUESTS = [dict(r, logprobs=4 if i % 2 else 1, **({"prompt_logprobs": 3} if i != 1 else {}))
               for i, r in enumerate(REQUESTS)]
LONG = 2                       # LP_REQUESTS[2]: the 200-token prompt (several prefill chunks)
assert LP_REQUESTS[LONG]["prompt_ids"] == LONG_PROMPT


def outcome(results):
    """Everything of each result the client sees: tokens, their log-probs, the prompt's."""
    return [(r.token_ids, r.logprobs, r.prompt_logprobs) for r in results]


@pytest.fixture(scope="module")
def lp_reference(tiny_model):
    with SidecarProcess(["--model", str(tiny_model), *LP_FLAGS, "--standbys", "0"]) as sc:
        sc.wait_steady(standbys=0)
        with sc.new_client(timeout=60) as client:
            out = outcome(wait_all(submit(client, LP_REQUESTS)))
    for (tokens, lps, prompt), r in zip(out, LP_REQUESTS):
        assert len(lps) == len(tokens) and all(len(lp.top) == r["logprobs"] for lp in lps)
        assert (prompt is None) == ("prompt_logprobs" not in r)
    assert len(out[LONG][2]) == len(LONG_PROMPT) and out[LONG][2][0].logprob is None
    return out


def _tables(sc):
    return Tables.attach_name(f"/kvhold-{os.getuid()}-{sc.instance}-tables")


def _slot_of(tables, prompt_len):
    r = tables.requests
    hit = ((r["admit_state"] != 0) & (r["prompt_len"] == prompt_len)).nonzero()[0]
    return int(hit[0]) if len(hit) else None


def _kill_active(sc):
    pid = sc.wait_steady(standbys=0)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _committed(tables, streams):
    """The tokens committed for these streams' requests so far: their records stay in their slots
    after they end (nothing else is admitted meanwhile), so the count only grows."""
    r = tables.requests
    ours = np.isin(r["request_id"], [s.request_id for s in streams]) & (r["exec_request_id"] == r["request_id"])
    return int(r["num_generated"][ours].sum())


def test_sigkill_mid_prefill_and_mid_stream_keeps_every_logprob(tiny_model, lp_reference, start_sidecar, tmp_path):
    # 1. the active executor stops itself at the 3rd step of the long prompt (before its forward:
    # two prefill chunks committed, more to come), however slowly this test follows; `armed` keeps
    # the fault to that round
    armed = tmp_path / "armed"
    env = {"KVHOLD_FAULT": f"step:token={unique_prompt_token(tiny_model, LP_REQUESTS, LONG)}@3:stop",
           "KVHOLD_FAULT_IF": str(armed), "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *LP_FLAGS, "--lease-ms", "30000"], env=env)
    pid = sc.wait_steady()["pid"]
    tables = _tables(sc)
    kills = 0
    with sc.new_client(timeout=60) as client:
        # during the long prompt's prefill: some of its prompt log-probs are in the table, not all
        armed.touch()
        streams = submit(client, LP_REQUESTS)
        wait_stopped(pid, 60)
        armed.unlink()
        slot = _slot_of(tables, len(LONG_PROMPT))
        r = tables.requests
        done = int(r["lp_done"][slot])
        assert 1 < done < len(LONG_PROMPT) and int(r["exec_request_id"][slot]) == int(r["request_id"][slot])
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        kills += 1
        assert outcome(wait_all(streams)) == lp_reference, f"killed with lp_done {done}"
        # 2. mid-stream: after a chosen number of committed tokens, twice
        for threshold in (25, 90):
            sc.wait_steady()
            streams = submit(client, LP_REQUESTS)
            wait_until(lambda: _committed(tables, streams) >= threshold, interval_s=0.0005, timeout_s=30,
                       what=f"{threshold} tokens committed")
            _kill_active(sc)
            kills += 1
            assert outcome(wait_all(streams)) == lp_reference, f"killed after {threshold} tokens"
    recoveries = sc.wait_for(lambda st: len(st["recoveries"]) >= kills and st["recoveries"], timeout=60)
    assert all(rec["requests_lost"] == 0 for rec in recoveries)


def _run_with_fault(start_sidecar, tiny_model, tmp_path, fault, requests):
    """The requests' outcome on a sidecar whose executor dies once at `fault`, and its recoveries."""
    return run_with_fault(start_sidecar, ["--model", str(tiny_model), *LP_FLAGS], tmp_path, fault, requests, outcome)


@pytest.mark.parametrize("fault", ["commit_pages:3:kill", "commit_begin:9:kill", "commit_journal:12:kill"])
def test_death_between_commit_stages_keeps_every_logprob(tiny_model, lp_reference, start_sidecar,
                                                         tmp_path, fault):
    got, rec = _run_with_fault(start_sidecar, tiny_model, tmp_path, fault, LP_REQUESTS)
    assert got == lp_reference
    assert len(rec) == 1


@pytest.mark.parametrize("fault", ["commit_pages:2:kill", "commit_begin:3:kill"])
def test_death_after_a_middle_prefill_chunk_keeps_its_prompt_logprobs(tiny_model, lp_reference,
                                                                      start_sidecar, tmp_path, fault):
    """The long prompt alone: its second chunk's pages are published (or about to be) when the
    executor dies; the successor keeps them and does not compute their prompt log-probs again."""
    got, rec = _run_with_fault(start_sidecar, tiny_model, tmp_path, fault, [LP_REQUESTS[LONG]])
    assert got == [lp_reference[LONG]]
    assert len(rec) == 1 and rec[0]["tokens_kept"] >= 64     # the published chunks were kept


@pytest.mark.parametrize("fault", ["publish_counts:1:kill", "publish_counts:2:kill", "publish_counts:5:kill"])
def test_death_inside_a_page_publish_loses_no_request(tiny_model, lp_reference, start_sidecar, tmp_path, fault):
    """The executor dies inside a page publish, its pages' new counts written and not yet their
    checksums (the first prefill chunk's pages, or a later step's): the successor keeps the rows
    each page had committed before (those its recorded checksum covers), so no request is lost
    or damaged, and every token and log-prob equals an uninterrupted run's."""
    got, rec = _run_with_fault(start_sidecar, tiny_model, tmp_path, fault, LP_REQUESTS)
    assert got == lp_reference
    assert len(rec) == 1 and rec[0]["pages_interrupted"] > 0, rec
    assert rec[0]["requests_lost"] == rec[0]["requests_damaged"] == 0, rec
