"""Flags as people coming from vLLM type them: --max-model-len, --dtype, --gpu-memory-utilization,
a --log-level with choices; and the sidecar's periodic stats line."""
import argparse

import pytest

from kvhold.serving.flags import add_router_args, add_serve_args
from kvhold.sidecar.config import EXECUTOR_RESERVE_BYTES, PoolConfig, SettingError, SidecarConfig
from kvhold.sidecar.flags import sidecar_config_from_args
from kvhold.sidecar.stats_log import StatsLog
from kvhold.serving.serve import sidecar_argv


def parse(*argv, router=False):
    p = argparse.ArgumentParser(exit_on_error=False)
    (add_router_args if router else add_serve_args)(p)
    return p.parse_args(list(argv))


def test_vllm_names_are_aliases_of_kvholds(tiny_model):
    args = parse("--model", str(tiny_model), "--max-model-len", "128", "--dtype", "half", "--log-level", "debug")
    assert args.max_seq_len == 128 and args.compute_dtype == "float16" and args.log_level == "DEBUG"
    cfg = sidecar_config_from_args(args)
    assert cfg.pool.max_seq_len == 128 and cfg.pool.compute_dtype == "float16"
    assert parse("--model", str(tiny_model), "--dtype", "auto").compute_dtype is None
    assert parse("--model", str(tiny_model), "--dtype", "float").compute_dtype == "float32"
    assert parse("--max-model-len", "64", router=True).max_seq_len == 64
    again = parse(*sidecar_argv(args))               # what `kvhold serve` hands its sidecar
    assert (again.max_seq_len, again.compute_dtype) == (128, "float16")


@pytest.mark.parametrize("argv, match", [
    (("--dtype", "int8"), "unknown dtype 'int8'"),
    (("--log-level", "loud"), "invalid choice"),
    (("--gpu-memory-utilization", "1.5"), r"must be in \(0, 1\]"),
    (("--gpu-memory-utilization", "0.9", "--kv-pages", "64"), "not allowed with"),
])
def test_bad_values_are_refused_by_name(argv, match):
    with pytest.raises(argparse.ArgumentError, match=match):
        parse(*argv)


def test_gpu_memory_utilization_needs_a_gpu_and_leaves_weights_and_reserves(tiny_model):
    with pytest.raises(SettingError, match="needs a CUDA device"):
        PoolConfig(model=tiny_model, gpu_memory_utilization=0.9)
    pool = PoolConfig(model=tiny_model, backend="cuda", device="cuda:0", gpu_memory_utilization=0.5,
                      compute_dtype="bfloat16")
    cfg = SidecarConfig(pool=pool)
    from kvhold.protocol.model_spec import ModelSpec
    spec = ModelSpec.from_dir(tiny_model)
    total = 80 << 30
    kv = cfg.kv_bytes_for_utilization(spec, total_bytes=total)
    weights = 2 * sum(__import__("math").prod(s) for s in spec.expected_tensors().values())
    assert kv == (40 << 30) - weights - 2 * EXECUTOR_RESERVE_BYTES      # active + 1 standby
    with pytest.raises(SettingError, match="leaves no KV memory"):
        cfg.kv_bytes_for_utilization(spec, total_bytes=4 << 30)


def test_the_stats_line_reports_an_interval_and_stays_silent_when_idle():
    stats = StatsLog(10.0)
    numbers = dict(prompt_tokens=0, generated_tokens=0, running=0, waiting=0, pages_used=0,
                   pages_total=100, recoveries=0)
    assert stats.due(0) and stats.line(0, **numbers) is None           # the first sample
    assert not stats.due(5 * 10**9)
    busy = dict(numbers, prompt_tokens=500, generated_tokens=200, running=3, waiting=1, pages_used=25,
                recoveries=1)
    text = stats.line(10 * 10**9, **busy)
    assert text == ("prompt throughput 50.0 tokens/s, generation throughput 20.0 tokens/s, running 3, "
                    "waiting 1, KV pages 25/100 (25.0% used), recoveries 1")
    assert stats.line(20 * 10**9, **dict(busy, running=0, waiting=0)) is None     # idle: silent
    assert not StatsLog(0).due(10**12)


def test_the_stats_line_gives_the_prefix_cache_hit_rate_of_its_interval():
    stats = StatsLog(10.0)
    numbers = dict(prompt_tokens=0, generated_tokens=0, running=1, waiting=0, pages_used=0,
                   pages_total=100, recoveries=0)
    stats.line(0, **numbers, prefix_cache={"queries": 1000, "hits": 0, "hit_rate": 0.0})
    text = stats.line(10 * 10**9, **numbers, prefix_cache={"queries": 1400, "hits": 300, "hit_rate": 0.21})
    assert text.endswith(", prefix cache hit rate 75.0%")           # 300 of the interval's 400
    assert "prefix cache" not in stats.line(20 * 10**9, **numbers, prefix_cache={"queries": 1400, "hits": 300})
    assert "prefix cache" not in stats.line(30 * 10**9, **numbers)
