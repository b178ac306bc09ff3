"""`kvhold serve --sidecar-endpoint`: what configures a sidecar serve would start is refused by name."""
import argparse

import pytest

from kvhold.serving.flags import add_serve_args
from kvhold.serving.serve import ServeConfig, serve_config_from_args


def config(*argv):
    p = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(p)
    return serve_config_from_args(p.parse_args(["--sidecar-endpoint", "ipc:///tmp/x/client.sock", *argv]))


@pytest.mark.parametrize("argv, flags", [
    (("--standbys", "2"), "--standbys"),
    (("--max-seq-len", "128", "--device", "cuda:0"), "--device, --max-seq-len"),
    (("--instance", "other"), "--instance"),
    (("--lease-ms", "3000"), "--lease-ms"),
    (("--zygote",), "--zygote"),
])
def test_sidecar_flags_are_refused_with_their_names(argv, flags):
    with pytest.raises(ValueError, match=f"^{flags}: a flag of the sidecar that kvhold serve starts"):
        config(*argv)


def test_what_stays_meaningful_is_kept(tiny_model, tmp_path):
    cfg = config("--model", str(tiny_model), "--runtime-root", str(tmp_path), "--log-level", "debug",
                 "--port", "0", "--served-model-name", "m", "--start-timeout", "5")
    assert cfg.sidecar_endpoint == cfg.endpoint == "ipc:///tmp/x/client.sock"
    assert (cfg.model, cfg.runtime_root, cfg.log_level, cfg.start_timeout_s) == (tiny_model, tmp_path, "DEBUG", 5.0)
    assert cfg.sidecar_argv == ()
    # what the HTTP server process gets keeps the endpoint
    assert ServeConfig.from_json(cfg.to_json()).endpoint == "ipc:///tmp/x/client.sock"


@pytest.mark.parametrize("argv, match", [
    (("--model", "/nonexistent/ckpt"), "--model /nonexistent/ckpt: not a directory"),
])
def test_bad_front_flags(argv, match):
    with pytest.raises(ValueError, match=match):
        config(*argv)


def test_an_endpoint_that_is_no_zeromq_address_is_refused():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_serve_args(p)
    with pytest.raises(ValueError, match="ipc://PATH or tcp://HOST:PORT"):
        serve_config_from_args(p.parse_args(["--sidecar-endpoint", "/tmp/x/client.sock"]))
