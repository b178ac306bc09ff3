"""`kvhold serve --http-restart-backoff-s / --frontend-restart-backoff-s`: parsed and checked,
kept in the supervisor's configuration, refused where they mean nothing."""
import argparse

import pytest

from kvhold.serving.flags import add_serve_args
from kvhold.serving.serve import FRONTEND_BACKOFF_S, RESTART_BACKOFF_S, serve_config_from_args


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(p)
    return p


def test_defaults_and_values_reach_the_supervisors_config(tiny_model):
    args = parser().parse_args(["--model", str(tiny_model)])
    cfg = serve_config_from_args(args)
    assert (cfg.http_restart_backoff_s, cfg.frontend_restart_backoff_s) == (RESTART_BACKOFF_S, FRONTEND_BACKOFF_S)
    args = parser().parse_args(["--model", str(tiny_model), "--http-restart-backoff-s", "1,4",
                                "--frontend-restart-backoff-s", "0,0"])
    cfg = serve_config_from_args(args)
    assert (cfg.http_restart_backoff_s, cfg.frontend_restart_backoff_s) == ((1.0, 4.0), (0.0, 0.0))


@pytest.mark.parametrize("value", ["1", "4,1", "a,b", "-1,2", "1,5000"])
def test_bad_values_are_refused(value):
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--http-restart-backoff-s", value])


def test_the_frontend_delay_is_refused_with_a_sidecar_endpoint():
    args = parser().parse_args(["--sidecar-endpoint", "ipc:///tmp/x/client.sock",
                                "--frontend-restart-backoff-s", "1,2"])
    with pytest.raises(ValueError, match="runs no frontend"):
        serve_config_from_args(args)
