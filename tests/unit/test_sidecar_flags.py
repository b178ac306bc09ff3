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
    dests = {a.dest for a in parser._actions} - {"help", "instance", "runtime_root", "log_level"}
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
