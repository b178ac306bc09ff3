"""A sidecar for TensorRT-LLM launchers (`--workload trtllm --kv-mode foreign --no-spawn`) refuses at
admission what they cannot honour: INVALID_PARAMS (an HTTP 400) naming the field, nothing
journaled. The launcher's own admission refuses the same fields, without TensorRT-LLM:
a journal request that sets a field of its `unsupported` list (log-probs included: the bridge
neither asks TensorRT-LLM for them nor journals them) is finished with ERROR, never submitted,
and the executor's log names the field; any other request is submitted. Real shared-memory
tables (tests.unit.helpers.ShmPool) with a log-prob area, as the engine workload's sidecar that
these launchers attach to has one."""
import argparse
import logging
import types
from types import SimpleNamespace

import pytest

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import ExecState, FinishReason, KvGeometry, TableGeometry
from kvhold.protocol.sampling import SamplingParams
from kvhold.frontend.frontend import Frontend
from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.settings import BRIDGE_UNSUPPORTED, UNSUPPORTED_SAMPLING
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.testing.frontend_host import FrontendHost
from kvhold.trtllm_bridge import launcher
from tests.unit.helpers import FINGERPRINT

TRTLLM = ["--workload", "trtllm", "--kv-mode", "foreign", "--no-spawn"]


def config(tiny_model, *flags):
    parser = argparse.ArgumentParser()
    add_sidecar_args(parser)
    return sidecar_config_from_args(parser.parse_args(["--model", str(tiny_model), *flags]))


def test_the_trtllm_workload_is_a_foreign_pool_of_launchers_it_does_not_spawn(tiny_model):
    cfg = config(tiny_model, *TRTLLM)
    assert cfg.executor_settings().workload == "trtllm"
    geometry = cfg.table_geometry(ModelSpec.from_dir(tiny_model))
    assert geometry.max_logprobs == 0 and geometry.max_extra_bytes == 0     # no log-prob nor grammar area
    assert UNSUPPORTED_SAMPLING["trtllm"] == launcher.UNSUPPORTED            # admission and launcher agree
    for flags, named in [(["--workload", "trtllm", "--no-spawn"], "--kv-mode foreign"),
                         (["--workload", "trtllm", "--kv-mode", "foreign"], "--no-spawn"),
                         ([*TRTLLM, "--zygote"], "--zygote")]:
        with pytest.raises(ValueError, match=named.replace("-", r"\-")):
            config(tiny_model, *flags)


@pytest.fixture
def table_geometry(tiny_model):
    """The tables such a sidecar makes (`tables` in tests/unit/conftest.py)."""
    return config(tiny_model, *TRTLLM).table_geometry(ModelSpec.from_dir(tiny_model))


@pytest.mark.parametrize("params", [dict(min_tokens=2), dict(presence_penalty=0.5), dict(frequency_penalty=0.5),
                                    dict(repetition_penalty=1.2), dict(min_p=0.1), dict(logit_bias={"5": 2.0}),
                                    dict(logprobs=0), dict(prompt_logprobs=1)], ids=lambda p: next(iter(p)))
def test_the_trtllm_workload_refuses_what_the_launchers_cannot_honour_at_admission(tiny_model, tables, tmp_path,
                                                                                  params):
    durable = DurableJournal(tmp_path / "journal")
    fe = Frontend(tables, types.SimpleNamespace(vocab_size=ModelSpec.from_dir(tiny_model).vocab_size), None,
                  runs_model=True, durable=durable, fingerprint=FINGERPRINT, timeline=RecoveryTimeline(),
                  host=FrontendHost(), unsupported=UNSUPPORTED_SAMPLING["trtllm"])
    reply = fe.handle(b"uclient", m.Generate(tag=1, params={"max_tokens": 2, **params}, prompt_ids=[1, 2]))
    assert isinstance(reply, m.Error) and reply.code == ErrorCode.INVALID_PARAMS, reply
    assert reply.message.startswith(next(iter(params))), reply.message
    assert not list(durable.dir.glob("req-*")) and Journal(tables).num_free_slots() == tables.geometry.num_slots
    plain = fe.handle(b"uclient", m.Generate(tag=2, params={"max_tokens": 2}, prompt_ids=[1, 2]))
    assert not isinstance(plain, m.Error), plain                             # the rest is admitted


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
