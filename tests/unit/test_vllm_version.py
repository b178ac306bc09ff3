"""The vLLM bridge runs the vLLM releases it was verified with, refuses others naming both, and
runs them anyway, with a warning, under --vllm-any-version (which reaches the executor)."""
import argparse
import logging

import pytest

from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args
from kvhold.vllm_bridge import VERIFIED_VLLM, check_vllm_version


@pytest.mark.parametrize("installed", [VERIFIED_VLLM[0], VERIFIED_VLLM[0] + "+cpu"])
def test_a_verified_release_runs(installed):
    check_vllm_version(installed)


def test_another_release_is_refused_naming_it_the_verified_ones_and_the_flag():
    with pytest.raises(RuntimeError, match=r"vLLM 0\.99\.1 is not .*0\.32\.0.*--vllm-any-version"):
        check_vllm_version("0.99.1")


def test_the_flag_runs_it_with_a_warning(caplog, tiny_model):
    with caplog.at_level(logging.WARNING, logger="kvhold.vllm_bridge"):
        check_vllm_version("0.99.1", any_version=True)
    assert "0.99.1" in caplog.text and "--vllm-any-version" in caplog.text
    parser = argparse.ArgumentParser()
    add_sidecar_args(parser)
    base = ["--model", str(tiny_model), "--workload", "vllm", "--kv-mode", "foreign", "--page-tokens", "32"]
    assert not sidecar_config_from_args(parser.parse_args(base)).executor_settings().vllm_any_version
    cfg = sidecar_config_from_args(parser.parse_args([*base, "--vllm-any-version"]))
    assert cfg.executor_settings().vllm_any_version
