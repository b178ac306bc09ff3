"""The exact-prefill setting: on by default, `--no-exact-prefill` turns it off, and it reaches
the executors' settings over the wire (kvhold.executor.cuda.runner reads it; the CPU engine
is exact in every path without it)."""
import argparse

import pytest

from kvhold.protocol.settings import ExecutorSettings
from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args


def _config(argv):
    p = argparse.ArgumentParser()
    add_sidecar_args(p)
    return sidecar_config_from_args(p.parse_args(argv))


@pytest.mark.parametrize("argv,want", [([], True), (["--exact-prefill"], True), (["--no-exact-prefill"], False)])
def test_the_flag_reaches_the_executor_settings_and_survives_the_wire(argv, want):
    settings = _config(argv).executor_settings()
    assert settings.exact_prefill is want
    assert ExecutorSettings.from_wire(settings.to_wire()).exact_prefill is want


def test_a_non_boolean_exact_prefill_is_refused_by_name():
    assert ExecutorSettings(exact_prefill=False).exact_prefill is False
    with pytest.raises(TypeError, match="exact_prefill must be bool"):
        ExecutorSettings(exact_prefill="yes")
