"""`kvhold serve`: a sidecar (with its active and standby executors) plus the HTTP API.

The sidecar runs as a child process (`python -m kvhold sidecar ...`, in its own
session, sent SIGTERM if this process dies); this process waits until it can serve,
then runs uvicorn with the FastAPI app (kvhold.serving.http_api). The sidecar, not this
process, owns the memory and the in-flight requests: an executor crash is handled
there, and HTTP streams merely pause.

SIGTERM or SIGINT drains: new requests get 503 and /health turns 503 at once, the
streams in flight finish (for at most --drain-timeout seconds), then the HTTP server
and the sidecar stop and the process exits 0. A second signal stops at once. If the
sidecar dies, the server exits 1 so that a process supervisor restarts both.
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvhold.protocol.naming import InstancePaths
from kvhold.serving.http_guards import HttpGuards

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: Path
    served_model_name: str
    host: str
    port: int
    api_key: str | None
    instance: str
    runtime_root: Path | None
    sidecar_argv: tuple[str, ...]
    lease_ms: int
    context_len: int
    start_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    guards: HttpGuards = HttpGuards()

    @property
    def endpoint(self) -> str:
        return InstancePaths.for_instance(self.instance, self.runtime_root).client_endpoint


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Validate the serve flags (ValueError on a bad one) and resolve `--model demo`."""
    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.sidecar.flags import sidecar_config_from_args

    if str(args.model) == "demo":
        from kvhold.testing.make_model import ensure_demo_model
        args.model = ensure_demo_model()[0]
    if args.model is None:
        raise ValueError("--model is required (a checkpoint directory, or 'demo')")
    api_key = http_flags_from_args(args)
    geometry = sidecar_config_from_args(args).table_geometry(ModelSpec.from_dir(args.model))
    return ServeConfig(model=Path(args.model), served_model_name=args.served_model_name or Path(args.model).name,
                       host=args.host, port=args.port, api_key=api_key, instance=args.instance,
                       runtime_root=args.runtime_root, sidecar_argv=tuple(sidecar_argv(args)),
                       lease_ms=args.lease_ms, context_len=geometry.max_seq_len,
                       start_timeout_s=args.start_timeout, drain_timeout_s=args.drain_timeout,
                       log_level=args.log_level, guards=HttpGuards.from_args(args))


def http_flags_from_args(args: argparse.Namespace) -> str | None:
    """Check --port; the API key from --api-key or --api-key-file (None: no key)."""
    api_key = args.api_key
    if args.api_key_file is not None:
        api_key = Path(args.api_key_file).read_text().strip()
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port {args.port} is not a TCP port")
    return api_key


def sidecar_argv(args: argparse.Namespace) -> list[str]:
    """The `kvhold sidecar` flags that reproduce the sidecar part of `args` (non-defaults only)."""
    from kvhold.sidecar.flags import add_sidecar_args

    reference = argparse.ArgumentParser(add_help=False)
    add_sidecar_args(reference)
    out: list[str] = []
    for action in reference._actions:
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class SidecarChild:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None

    def start(self) -> "SidecarChild":
        cmd = [sys.executable, "-m", "kvhold", "sidecar", *self.config.sidecar_argv]
        self.proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
        log.info("started sidecar pid %d: %s", self.proc.pid, " ".join(cmd[3:]))
        return self

    def wait_until_serving(self) -> None:
        from kvhold.client.client import Client
        from kvhold.protocol.errors import KvholdError
        from kvhold.serving.http_api import serving_state

        deadline = time.monotonic() + self.config.start_timeout_s
        reason = "no answer yet"
        with Client(self.config.endpoint, timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the sidecar exited with code {self.proc.returncode} during start-up")
                try:
                    status = client.status()
                    ok, reason = serving_state(status, self.config.lease_ms)
                    if ok and status["pid"] == self.proc.pid:
                        return
                except KvholdError as exc:
                    reason = str(exc)
                time.sleep(0.05)
        raise TimeoutError(f"the sidecar could not serve within {self.config.start_timeout_s:.0f} s: {reason}")

    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("sidecar pid %d did not stop in %.0f s: SIGKILL", self.proc.pid, timeout)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains instead of closing the listener at once.
    With a `child` (kvhold serve), the server also stops when that sidecar exits."""

    def __init__(self, config: uvicorn.Config, gate, child: SidecarChild | None, drain_timeout_s: float):
        super().__init__(config)
        self.gate, self.child, self.drain_timeout_s = gate, child, drain_timeout_s
        self.drain_deadline: float | None = None
        self.exit_code = 0

    def handle_exit(self, sig: int, frame) -> None:
        if self.drain_deadline is None:
            self.gate.draining = True
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
            log.info("%s: draining %d streams (at most %.0f s)", signal.Signals(sig).name,
                     len(self.gate.active), self.drain_timeout_s)
        else:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if self.child is not None and self.child.exited():
            log.critical("the sidecar exited with code %s: stopping", self.child.proc.returncode)
            self.exit_code = 1
            return True
        if self.drain_deadline is not None:
            return self.gate.idle or time.monotonic() > self.drain_deadline
        return False


def run_serve(config: ServeConfig) -> int:
    from kvhold.serving.http_api import AppSettings, create_app

    child = SidecarChild(config).start()
    try:
        child.wait_until_serving()
        app = create_app(AppSettings(endpoint=config.endpoint, model_dir=config.model,
                                     served_model_name=config.served_model_name,
                                     context_len=config.context_len, lease_ms=config.lease_ms,
                                     api_key=config.api_key, body_timeout_s=config.guards.body_timeout_s))
        server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port,
                                               log_level=config.log_level.lower(), access_log=False,
                                               timeout_graceful_shutdown=5,
                                               **config.guards.uvicorn_options()),
                                app.state.service.gate, child, config.drain_timeout_s)
        log.info("serving %r on http://%s:%d (sidecar instance %r)", config.served_model_name,
                 config.host, config.port, config.instance)
        server.run()
        return server.exit_code
    finally:
        child.stop()
        log.info("stopped")
