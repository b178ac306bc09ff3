"""`--workload vllm`: what the sidecar accepts and what it refuses, named, before any executor
starts; the executor program it spawns for it. (vLLM itself is exercised in tests/vllm_bridge.)"""
import argparse

import pytest

from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args
from kvhold.sidecar.supervisor import EXECUTOR_MODULES

BASE = ["--workload", "vllm", "--kv-mode", "foreign", "--page-tokens", "32"]


def config(tiny_model, *flags):
    parser = argparse.ArgumentParser()
    add_sidecar_args(parser)
    return sidecar_config_from_args(parser.parse_args(["--model", str(tiny_model), *flags]))


def test_vllm_workload_settings_and_program(tiny_model):
    cfg = config(tiny_model, *BASE)
    settings = cfg.executor_settings()
    assert settings.workload == "vllm" and settings.kv_mode == "foreign"
    assert cfg.pool.compute_dtype == "float32"          # the checkpoint's dtype, not the CPU float64
    assert EXECUTOR_MODULES["vllm"] == "kvhold.vllm_bridge"


def test_vllm_workload_keeps_vllms_prefix_caching_unless_told_not_to(tiny_model):
    # the executors pass it to vLLM as enable_prefix_caching (kvhold.vllm_bridge.workload.engine_kwargs)
    for flags, on in (([], True), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)):
        cfg = config(tiny_model, *BASE, *flags)
        assert cfg.uses_prefix_caching() is on and cfg.executor_settings().prefix_caching is on


@pytest.mark.parametrize("flags, named", [
    (["--workload", "vllm", "--page-tokens", "32"], "--kv-mode foreign"),
    ([*BASE[:-1], "16"], "multiple of 32"),
    ([*BASE, "--compute-dtype", "float64"], "float64"),
    ([*BASE, "--zygote"], "--zygote"),
    ([*BASE, "--cpu-threads", "2"], "--cpu-threads"),
    ([*BASE, "--prefill-chunk", "64"], "--prefill-chunk"),
])
def test_vllm_workload_refuses_what_it_cannot_run(tiny_model, flags, named):
    with pytest.raises(ValueError, match=named.replace("-", r"\-")):
        config(tiny_model, *flags)


def test_vllm_workload_needs_a_model():
    parser = argparse.ArgumentParser()
    add_sidecar_args(parser)
    with pytest.raises(ValueError, match="vllm workload needs --model"):
        sidecar_config_from_args(parser.parse_args(BASE))


def test_vllm_workload_journals_log_probs_idle_and_churn_do_not(tiny_model):
    from kvhold.protocol.model_spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_model)
    assert config(tiny_model, *BASE).table_geometry(spec).max_logprobs == 20             # --max-logprobs default
    assert config(tiny_model, *BASE, "--max-logprobs", "5").table_geometry(spec).max_logprobs == 5
    assert config(tiny_model, *BASE, "--max-logprobs", "0").table_geometry(spec).max_logprobs == 0
    for workload in ("idle", "churn"):
        cfg = config(tiny_model, "--workload", workload, "--max-logprobs", "5")
        assert cfg.table_geometry(spec).max_logprobs == 0
