"""The TensorRT-LLM launcher's admission refuses what it cannot honour, without TensorRT-LLM:
a journal request that sets a field of its `unsupported` list (log-probs included: the bridge
neither asks TensorRT-LLM for them nor journals them) is finished with ERROR, never submitted,
and the executor's log names the field; any other request is submitted. Real shared-memory
tables (tests.unit.helpers.ShmPool) with a log-prob area, as the engine workload's sidecar that
these launchers attach to has one."""
import logging
from types import SimpleNamespace

import pytest

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState, FinishReason, KvGeometry, TableGeometry
from kvhold.protocol.sampling import SamplingParams
from kvhold.protocol.settings import BRIDGE_UNSUPPORTED
from kvhold.trtllm_bridge import launcher


@pytest.fixture
def pool_geometry():
    kv = KvGeometry(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_tokens=4)
    return TableGeometry(kv=kv, num_pages=32, num_slots=4, max_seq_len=32, num_leases=2, max_logprobs=4)


def workload(tables):
    w = launcher.TrtllmWorkload(SimpleNamespace(tables=tables, lease=SimpleNamespace(check=lambda: None), epoch=1))
    w.journal = Journal(tables)
    w.submitted = []
    w._submit = lambda entry: w.submitted.append(entry.request_id)
    return w


def test_the_launcher_refuses_every_bridge_refusal_and_log_probs():
    assert set(BRIDGE_UNSUPPORTED) < set(launcher.TrtllmWorkload.unsupported)
    assert {"logprobs", "prompt_logprobs"} <= set(launcher.TrtllmWorkload.unsupported)
    assert SamplingParams().first_set(launcher.TrtllmWorkload.unsupported) is None
    assert SamplingParams(logprobs=0).first_set(launcher.TrtllmWorkload.unsupported) == "logprobs"
    assert SamplingParams(prompt_logprobs=0).first_set(launcher.TrtllmWorkload.unsupported) == "prompt_logprobs"


@pytest.mark.parametrize("field, params", [
    ("logprobs", dict(logprobs=0)),                   # the token's own log-prob only
    ("logprobs", dict(logprobs=3)),
    ("prompt_logprobs", dict(prompt_logprobs=2)),
    ("min_tokens", dict(min_tokens=2)),
])
def test_a_request_asking_for_an_unsupported_field_is_finished_with_error_naming_it(pool, caplog, field, params):
    w = workload(pool.tables)
    j = w.journal
    refused, plain = j.new_request_id(), j.new_request_id()
    j.admit(0, refused, [1, 2, 3], SamplingParams(max_tokens=4, seed=1, **params))
    j.admit(1, plain, [1, 2, 3], SamplingParams(max_tokens=4, seed=1))
    with caplog.at_level(logging.ERROR, logger="kvhold.executor.engine_bridge"):
        w._admit()
    e = j.entry(0)
    assert e.taken and e.exec_state == ExecState.FINISHED
    assert int(pool.tables.requests["finish_reason"][0]) == FinishReason.ERROR
    assert e.num_generated == 0
    assert w.submitted == [plain]
    assert f"request {refused:#x} refused: this engine does not support {field}" in caplog.text
