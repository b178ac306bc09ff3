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


def test_more_of_vllms_names_are_aliases_of_kvholds(tiny_model, tmp_path):
    args = parse(str(tiny_model), "--max-num-seqs", "32", "--block-size", "32", "--enforce-eager",
                 "--disable-log-stats", "--seed", "7", "--kv-cache-dtype", "auto", "--generation-config", "vllm",
                 "--disable-log-requests", "--uvicorn-log-level", "warning")
    assert (args.model_arg, args.max_batch, args.page_tokens, args.cuda_graph, args.stats_interval, args.seed) \
        == (tiny_model, 32, 32, False, 0.0, 7)
    from kvhold.serving.serve import serve_config_from_args
    args.runtime_root = tmp_path
    config = serve_config_from_args(args)
    assert config.model == tiny_model and config.uvicorn_log_level == "warning"
    cfg = sidecar_config_from_args(args)
    assert (cfg.pool.seed, cfg.pool.page_tokens, cfg.logs.stats_interval_s) == (7, 32, 0.0)
    assert cfg.executor_settings().cuda_graph is False and cfg.executors.max_batch == 32
    again = parse(*sidecar_argv(args))              # what `kvhold serve` hands its sidecar
    assert (again.max_batch, again.page_tokens, again.cuda_graph, again.stats_interval, again.seed) \
        == (32, 32, False, 0.0, 7)
    twice = parse(str(tiny_model), "--model", str(tmp_path))
    twice.runtime_root = tmp_path
    with pytest.raises(ValueError, match="given twice"):
        serve_config_from_args(twice)


@pytest.mark.parametrize("argv, match", [
    (("--trust-remote-code",), "never runs a checkpoint's own code"),
    (("--kv-cache-dtype", "fp8"), "compute dtype"),
    (("--generation-config", "auto"), "generation_config.json"),
    (("--tokenizer", "some/tokenizer"), "checkpoint directory"),
    (("--quantization", "awq"), "quantized weights are not built"),
    (("--swap-space", "4"), "recompute"),
])
def test_vllm_flags_kvhold_has_no_counterpart_for_are_refused_saying_why(argv, match):
    with pytest.raises(argparse.ArgumentError, match=match) as exc:
        parse(*argv)
    assert argv[0] in str(exc.value)                    # argparse names the flag


def test_a_chat_template_file_or_text_and_a_bad_one(tiny_model, tmp_path):
    from kvhold.serving.chat_template import ChatTemplate
    from kvhold.serving.serve import serve_config_from_args

    source = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    (tmp_path / "t.jinja").write_text(source)
    for given in (str(tmp_path / "t.jinja"), source):
        args = parse("--model", str(tiny_model), "--chat-template", given)
        args.runtime_root = tmp_path
        config = serve_config_from_args(args)
        assert config.chat_template == source
        rendered = ChatTemplate.for_checkpoint(tiny_model, config.chat_template).render(
            [{"role": "user", "content": "hi"}])
        assert rendered == "<user>hi<assistant>"
    for bad, match in (("no/such/file.jinja", "neither a file nor a Jinja template"),
                       ("{% for m in messages %}", "--chat-template")):
        args = parse("--model", str(tiny_model), "--chat-template", bad)
        args.runtime_root = tmp_path
        with pytest.raises(ValueError, match=match):
            serve_config_from_args(args)


def test_config_errors_name_flags_not_settings(tiny_model):
    args = parse("--model", str(tiny_model), "--gpu-memory-utilization", "0.5")
    with pytest.raises(ValueError) as exc:
        sidecar_config_from_args(args)
    assert "--kv-memory or --kv-pages" in str(exc.value) and "pool." not in str(exc.value)
