"""The one table between the sidecar's flags and its config sections covers every flag."""
import argparse

from kvhold.sidecar.flags import FLAGS, SETTINGS, add_sidecar_args, sidecar_config_from_args


def _parser():
    p = argparse.ArgumentParser()
    add_sidecar_args(p)
    return p


def test_every_setting_has_a_real_flag_and_every_flag_a_setting():
    parser = _parser()
    options = {o: a.dest for a in parser._actions for o in a.option_strings}
    assert all(options.get(flag) == SETTINGS[path] for path, flag in FLAGS.items())
    # (vLLM's flags that kvhold refuses set nothing: argparse.SUPPRESS)
    dests = {a.dest for a in parser._actions} - {"help", "instance", "runtime_root", "log_level", "==SUPPRESS=="}
    assert dests == set(SETTINGS.values())


def test_flags_reach_their_sections():
    config = sidecar_config_from_args(_parser().parse_args(
        ["--kv-memory", "1MiB", "--no-spawn", "--health", "off", "--registry-ttl", "9", "--restart-backoff-ms", "1,2"]))
    assert config.pool.kv_memory_bytes == 2**20 and not config.executors.spawn_executors
    assert config.health.source == "off" and config.registry.ttl_s == 9
    assert config.executors.restart_backoff_ms == (1, 2) and config.executors.workload == "idle"


def test_vllms_name_for_the_step_token_budget():
    config = sidecar_config_from_args(_parser().parse_args(["--max-num-batched-tokens", "832"]))
    assert config.executors.max_batch_tokens == 832


def test_the_zygote_is_on_by_default_for_the_engine_on_cpu_and_asked_for_elsewhere(tiny_model):
    def zygote(*argv):
        return sidecar_config_from_args(_parser().parse_args(["--model", str(tiny_model), *argv])).uses_zygote()

    assert zygote() is True
    assert zygote("--no-zygote") is False
    assert zygote("--workload", "churn") is False and zygote("--workload", "churn", "--zygote") is True


def test_serve_passes_both_forms_of_the_zygote_flag_to_its_sidecar():
    from kvhold.serving.flags import add_serve_args
    from kvhold.serving.serve import sidecar_argv

    p = argparse.ArgumentParser()
    add_serve_args(p)
    assert "--zygote" not in sidecar_argv(p.parse_args([])) and "--no-zygote" not in sidecar_argv(p.parse_args([]))
    assert "--zygote" in sidecar_argv(p.parse_args(["--zygote"]))
    assert "--no-zygote" in sidecar_argv(p.parse_args(["--no-zygote"]))


def test_prefix_caching_reaches_the_executors_and_is_refused_where_it_is_not_built(tiny_model):
    import pytest

    def config(*argv):
        return sidecar_config_from_args(_parser().parse_args(["--model", str(tiny_model), *argv]))

    assert config().executor_settings().prefix_caching is True            # on by default
    assert config("--enable-prefix-caching").executor_settings().prefix_caching is True
    assert config("--no-enable-prefix-caching").executor_settings().prefix_caching is False
    for extra in (["--kv-mode", "foreign"], ["--workload", "churn"]):
        assert config(*extra).executor_settings().prefix_caching is False  # off where unsupported
        with pytest.raises(ValueError, match="^--enable-prefix-caching is supported for the vllm workload and for the engine workload"):
            config("--enable-prefix-caching", *extra)
