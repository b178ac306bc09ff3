"""`kvhold serve`: a sidecar (with its active and standby executors), its client-facing
frontend and the HTTP API, as separate processes under a small supervisor (this process).

Processes (four failure domains):

    kvhold serve           supervisor: starts and watches the other three; binds the HTTP
                           port first (the HTTP server answers during the start-up, /health
                           503 "starting"), and holds it
    ├─ kvhold sidecar --external-frontend
    │                      the memory owner: memory, tables, executors, health; parses no
    │                      client input; own session; sent SIGTERM (a drain) if the
    │                      supervisor dies
    ├─ kvhold sidecar --external-frontend --spare
    │                      its spare: code loaded, holds nothing, waits to take over
    ├─ kvhold frontend     client sockets, admission, tokenizer, streams, durable journal
    │                      (kvhold.frontend.process); own session; SIGTERM if the supervisor dies
    └─ kvhold serve-http   uvicorn + the FastAPI app (kvhold.serving.http_api) on the
                           supervisor's listening socket; own session; SIGKILLed if the
                           supervisor dies

The sidecar, not the HTTP server, owns the memory and the in-flight requests: an executor
crash is handled there, and HTTP streams merely pause. A frontend that dies is restarted
(after 0.1 s, doubling up to 30 s while it keeps dying within a minute of its start; one whose
sidecar made a new pool re-executes itself, same pid): the new one adopts the requests of the shm
journal as streams, the HTTP server's SDK resumes them after its silence, and the executors
and the memory are not touched. The HTTP server is restarted when it
dies (after 0.5 s, doubling up to 30 s while it keeps dying within a minute of its start;
each death logged with its exit code or signal), and the sidecar with its executors is left
running. The port stays bound by the supervisor meanwhile, so new connections wait in its
backlog instead of being refused. The HTTP server speaks to the sidecar with a ZeroMQ routing
id of its instance's (`ServeConfig.routing_id`) from the same uid: a restarted one is the same owner
of the requests, which the sidecar holds meanwhile, and its clients take their streams up
again with `GET /v1/streams/{stream_id}` and Last-Event-ID, each only with the credential that
started it (kvhold.serving.stream_resume).
A stream nobody takes up is cancelled by the sidecar after --unclaimed-cancel-s.

SIGTERM or SIGINT drains: the HTTP server is told first (new requests get 503 and /health
turns 503 at once, the streams in flight finish, for at most --drain-timeout seconds), then
the sidecar is stopped and the process exits 0. A second signal stops at once. If the
sidecar dies (SIGKILL, an OOM kill, a crash), its spare takes over: a second `kvhold sidecar
--external-frontend --spare`, started once the sidecar serves (and 5 s after each takeover),
that has its code loaded and waits in the instance lock, which the kernel hands it at the
death (--no-sidecar-spare: none). Without a spare, or when the sidecar exited without holding
the lock (a start that failed: the spare waits on for the next holder), the sidecar is started
again at once (then after 1 s, 2 s). Either way its executors outlive it and wait with their memory
(--sidecar-wait-ms), the new sidecar re-adopts them with the tables and the in-flight requests (kvhold.sidecar.adoption),
and the HTTP server's streams resume with nothing recomputed. If it stops by itself (exit 0)
or dies a fourth time within a minute, the HTTP server is stopped and the supervisor exits
1 with the reason the sidecar gave, so that a process supervisor (systemd, Kubernetes)
restarts the whole.

`kvhold serve --sidecar-endpoint ENDPOINT` is the same supervisor and HTTP server in front of
a sidecar that already runs (`kvhold sidecar`), at its client endpoint: no sidecar is started
or stopped. The sidecar's status says its instance (the HTTP server's routing id), checkpoint
(its tokenizer, unless --model names a local copy), context length and lease; the flags that
configure a sidecar are refused; so is a second one in front of a sidecar whose HTTP server is
connected already (it could not be answered: the routing id is one per instance). The HTTP
server is restarted when it dies as above; a stop
(SIGTERM) drains it and exits 0, and the sidecar goes on. If the sidecar dies, /health is 503
and streams pause until it (restarted by whatever started it) re-adopts its executors.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from kvhold.protocol.naming import InstancePaths, http_routing_id
from kvhold.serving.http_guards import HttpGuards
from kvhold.sidecar.config import DEFAULT_MAX_PROMPT_BYTES

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1
CONFIG_ENV = "KVHOLD_SERVE_HTTP_CONFIG"   # the HTTP server's configuration, from the supervisor
RESTART_BACKOFF_S = (0.5, 30.0)        # the HTTP server's restart delay: first, largest
FRONTEND_BACKOFF_S = (0.1, 30.0)       # the frontend's: its clients' streams wait meanwhile
SIDECAR_RESTARTS = 3                   # sidecar deaths within HEALTHY_RUN_S before serve gives up
SIDECAR_RESTART_DELAY_S = 1.0          # times the restarts so far: 0 s, 1 s, 2 s
HTTP_ID_GRACE_S = 5.0                  # --sidecar-endpoint: how long another HTTP server's connection may linger
SPARE_DELAY_S = 5.0                    # a new spare sidecar's start, after one took over (or died)
HEALTHY_RUN_S = 60.0                   # an HTTP server that ran this long restarts at the first delay
STOP_SIGNAL = signal.SIGUSR1           # to the HTTP server: stop without a drain (the sidecar is gone)


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
    access_log: bool = True
    sse_keepalive_s: float = 10.0
    guards: HttpGuards = HttpGuards()
    sidecar_endpoint: str | None = None   # a sidecar that runs already (serve starts none)
    http_restart_backoff_s: tuple[float, float] = RESTART_BACKOFF_S          # the supervisor's only
    frontend_restart_backoff_s: tuple[float, float] = FRONTEND_BACKOFF_S
    sidecar_spare: bool = True            # a spare memory owner waits to take over (SidecarChild)
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES   # the sidecar's; the HTTP server bounds its text alike
    chat_template: str | None = None      # --chat-template's text (None: the checkpoint's)
    uvicorn_log_level: str | None = None  # the HTTP server's uvicorn loggers (None: --log-level)
    tool_call_parser: str = "auto"        # chat's tool_choice auto (kvhold.serving.tool_calls)

    @property
    def paths(self) -> InstancePaths:
        return InstancePaths.for_instance(self.instance, self.runtime_root)

    @property
    def endpoint(self) -> str:
        return self.sidecar_endpoint or self.paths.client_endpoint

    @property
    def routing_id(self) -> bytes:
        """The HTTP server's ZeroMQ routing id: one per instance, so a restarted server owns its requests."""
        return http_routing_id(self.instance)

    def to_json(self) -> str:
        """What the HTTP server process needs (sent in its environment: the API key is in it)."""
        return json.dumps({"model": str(self.model), "served_model_name": self.served_model_name,
                           "host": self.host, "port": self.port, "api_key": self.api_key,
                           "instance": self.instance,
                           "runtime_root": str(self.runtime_root) if self.runtime_root else None,
                           "lease_ms": self.lease_ms, "context_len": self.context_len,
                           "drain_timeout_s": self.drain_timeout_s, "log_level": self.log_level,
                           "access_log": self.access_log, "sse_keepalive_s": self.sse_keepalive_s,
                           "header_timeout_s": self.guards.header_timeout_s,
                           "body_timeout_s": self.guards.body_timeout_s,
                           "sidecar_endpoint": self.sidecar_endpoint, "max_prompt_bytes": self.max_prompt_bytes,
                           "chat_template": self.chat_template, "uvicorn_log_level": self.uvicorn_log_level,
                           "tool_call_parser": self.tool_call_parser})

    @classmethod
    def from_json(cls, text: str) -> "ServeConfig":
        d = json.loads(text)
        guards = HttpGuards(header_timeout_s=d.pop("header_timeout_s"), body_timeout_s=d.pop("body_timeout_s"))
        root = d.pop("runtime_root")
        return cls(model=Path(d.pop("model")), runtime_root=Path(root) if root else None, sidecar_argv=(),
                   guards=guards, **d)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Validate the serve flags (ValueError on a bad one) and resolve `--model demo`."""
    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.sidecar.flags import sidecar_config_from_args

    positional = getattr(args, "model_arg", None)
    if positional is not None:             # `kvhold serve MODEL`, as `vllm serve MODEL`
        if args.model is not None and Path(args.model) != Path(positional):
            raise ValueError(f"the model is given twice: {positional} and --model {args.model}")
        args.model = positional
    if str(args.model) == "demo":
        from kvhold.testing.make_model import ensure_demo_model
        args.model = ensure_demo_model()[0]
    if args.sidecar_endpoint is not None:
        return _front_config_from_args(args)
    if args.model is None:
        raise ValueError("--model is required (a checkpoint directory, or 'demo')")
    api_key = http_flags_from_args(args)
    sidecar_config = sidecar_config_from_args(args)
    geometry = sidecar_config.table_geometry(ModelSpec.from_dir(args.model))
    return ServeConfig(model=Path(args.model), served_model_name=args.served_model_name or Path(args.model).name,
                       host=args.host, port=args.port, api_key=api_key, instance=args.instance,
                       runtime_root=args.runtime_root, sidecar_argv=tuple(sidecar_argv(args)),
                       lease_ms=args.lease_ms, context_len=geometry.max_seq_len,
                       start_timeout_s=args.start_timeout, drain_timeout_s=args.drain_timeout,
                       log_level=args.log_level, access_log=args.access_log, sse_keepalive_s=args.sse_keepalive,
                       guards=HttpGuards.from_args(args), http_restart_backoff_s=tuple(args.http_restart_backoff_s),
                       frontend_restart_backoff_s=tuple(args.frontend_restart_backoff_s),
                       sidecar_spare=args.sidecar_spare, max_prompt_bytes=sidecar_config.pool.max_prompt_bytes,
                       **_http_extras(args))


def _http_extras(args: argparse.Namespace) -> dict:
    """--chat-template (a file, or the template itself) read and checked now; --uvicorn-log-level."""
    extras = {"uvicorn_log_level": getattr(args, "uvicorn_log_level", None),
              "tool_call_parser": getattr(args, "tool_call_parser", "auto")}
    text = getattr(args, "chat_template", None)
    if text is not None:
        path = Path(text)
        try:
            is_file = path.is_file()
        except OSError:                     # a template too long to be a path
            is_file = False
        if is_file:
            text = path.read_text()
        elif not any(mark in text for mark in ("{{", "{%")):
            raise ValueError(f"--chat-template {text[:80]!r}: neither a file nor a Jinja template")
        from kvhold.serving.chat_template import ChatTemplate
        try:
            ChatTemplate(text, origin="--chat-template")
        except Exception as exc:            # jinja2's syntax errors
            raise ValueError(f"--chat-template: {exc}") from None
        extras["chat_template"] = text
    return extras


# with --sidecar-endpoint, the sidecar flags that still mean something here; the others configure
# a sidecar that serve would start
FRONT_SIDECAR_FLAGS = ("model", "runtime_root", "log_level")


def _front_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """`--sidecar-endpoint`: the flags checked; the sidecar's part comes from it (`front_of_sidecar`)."""
    from kvhold.sidecar.flags import add_sidecar_args

    reference = argparse.ArgumentParser(add_help=False)
    add_sidecar_args(reference)
    first: dict[str, argparse.Action] = {}        # each dest's own flag (not a shorthand of it)
    for action in reference._actions:
        if action.option_strings:
            first.setdefault(action.dest, action)
    refused = [action.option_strings[0] for dest, action in first.items()
               if dest not in FRONT_SIDECAR_FLAGS and getattr(args, dest, action.default) != action.default]
    if refused:
        raise ValueError(f"{', '.join(refused)}: a flag of the sidecar that kvhold serve starts; with "
                         f"--sidecar-endpoint the running sidecar's own flags apply (give them to kvhold sidecar)")
    if not args.sidecar_endpoint.startswith(("ipc://", "tcp://")):
        raise ValueError(f"--sidecar-endpoint {args.sidecar_endpoint!r}: ipc://PATH or tcp://HOST:PORT")
    if args.model is not None and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: not a directory")
    if tuple(args.frontend_restart_backoff_s) != FRONTEND_BACKOFF_S:
        raise ValueError("--frontend-restart-backoff-s: with --sidecar-endpoint kvhold serve runs no frontend")
    if not args.sidecar_spare:
        raise ValueError("--no-sidecar-spare: with --sidecar-endpoint kvhold serve starts no sidecar")
    api_key = http_flags_from_args(args)
    return ServeConfig(model=Path(args.model) if args.model is not None else None,
                       served_model_name=args.served_model_name, host=args.host, port=args.port,
                       api_key=api_key, instance="", runtime_root=args.runtime_root, sidecar_argv=(),
                       lease_ms=0, context_len=0, start_timeout_s=args.start_timeout,
                       drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                       access_log=args.access_log, sse_keepalive_s=args.sse_keepalive,
                       guards=HttpGuards.from_args(args), sidecar_endpoint=args.sidecar_endpoint,
                       http_restart_backoff_s=tuple(args.http_restart_backoff_s), **_http_extras(args))


def front_of_sidecar(config: ServeConfig) -> ServeConfig:
    """The configuration completed with what the running sidecar at `sidecar_endpoint` says: its
    instance, checkpoint (unless --model named one), context length and lease. Waits for its
    answer for at most start_timeout_s (TimeoutError); RuntimeError if it cannot serve HTTP."""
    import dataclasses

    from kvhold.client.client import Client
    from kvhold.protocol.errors import KvholdError

    deadline = time.monotonic() + config.start_timeout_s
    reason = "no answer"
    with Client(config.sidecar_endpoint, timeout=1.0) as client:
        while True:
            try:
                status = client.status()
                break
            except KvholdError as exc:
                reason = str(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sidecar at {config.sidecar_endpoint} did not answer within "
                                   f"{config.start_timeout_s:.0f} s ({reason}; a CURVE endpoint is not "
                                   f"supported here: use the sidecar's ipc:// endpoint)")
            time.sleep(0.1)
        # one HTTP server per sidecar: the frontend's ROUTER drops a second connection under the
        # routing id, whose requests would never be answered. A connection of one that just
        # died is gone within milliseconds; one that stays is another kvhold serve's.
        via = "u" if config.sidecar_endpoint.startswith("ipc://") else "t"
        grace = time.monotonic() + HTTP_ID_GRACE_S
        while via in ((status.get("client_peers") or {}).get("http_server") or ()):
            if time.monotonic() > grace:
                raise RuntimeError(f"another kvhold serve is serving in front of the sidecar at "
                                   f"{config.sidecar_endpoint} (instance {status.get('instance')!r}): its "
                                   f"HTTP server is connected to it, and a sidecar serves one HTTP server "
                                   f"(stop that one first)")
            time.sleep(0.1)
            try:
                status = client.status()
            except KvholdError:
                pass
    serving = status.get("serving")
    if not isinstance(serving, dict):
        raise RuntimeError(f"the sidecar at {config.sidecar_endpoint} does not say its model and context "
                           f"length (a kvhold sidecar of another version?)")
    model = config.model or (Path(serving["model"]) if serving.get("model") else None)
    if model is None:
        raise RuntimeError(f"the sidecar at {config.sidecar_endpoint} serves no model")
    if not model.is_dir():
        raise RuntimeError(f"the sidecar's checkpoint {model} is not readable here: give --model, a local copy")
    return dataclasses.replace(config, model=model, served_model_name=config.served_model_name or model.name,
                               instance=status["instance"], lease_ms=int(serving["lease_ms"]),
                               context_len=int(serving["max_seq_len"]),
                               max_prompt_bytes=int(serving.get("max_prompt_bytes", DEFAULT_MAX_PROMPT_BYTES)))


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
        if isinstance(action, argparse.BooleanOptionalAction):   # --flag / --no-flag
            out.append(action.option_strings[0] if value else action.option_strings[1])
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            out.append(flag)
        elif isinstance(action, argparse._StoreConstAction):
            continue        # a shorthand (--disable-log-stats): its dest's own flag carries the value
        else:
            out += [flag, str(value)]
    return out


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _killed_with_parent() -> None:
    _die_with_parent(signal.SIGKILL)


def _how_it_ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class SidecarChild:
    """The memory owner (`kvhold sidecar --external-frontend`) and, with `sidecar_spare`, a spare
    of it (`--spare`): a second process, started once the owner serves (and again SPARE_DELAY_S
    after it took over), that waits in the instance lock and takes over the moment the owner
    dies, without a new process's start-up. `take_over` makes it the owner."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.restarts = 0
        self.spare: subprocess.Popen | None = None
        self.spare_due: float | None = None

    def _popen(self, *extra: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "kvhold", "sidecar", "--external-frontend", *extra, *self.config.sidecar_argv]
        proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
        log.info("started %s pid %d: %s", "a spare sidecar" if extra else "sidecar", proc.pid, " ".join(cmd[3:]))
        return proc

    def start(self) -> "SidecarChild":
        self.proc = self._popen()
        self.started = time.monotonic()
        return self

    def schedule_spare(self, now: float, delay: float = 0.0) -> None:
        if self.config.sidecar_spare and self.spare is None:
            self.spare_due = now + delay

    def watch_spare(self, now: float) -> None:
        """Start the spare when due; one that died is started again after SPARE_DELAY_S."""
        if self.spare is not None and self.spare.poll() is not None:
            log.error("the spare sidecar pid %d %s: starting another in %.0f s", self.spare.pid,
                      _how_it_ended(self.spare.returncode), SPARE_DELAY_S)
            self.spare = None
            self.schedule_spare(now, SPARE_DELAY_S)
        if self.spare_due is not None and now >= self.spare_due and not self.exited():
            self.spare_due = None
            self.spare = self._popen("--spare")

    def take_over(self, now: float) -> bool:
        """The owner exited: the spare, if one waits and takes over, is the owner now (it took
        the lock at the death). False if none takes over: none waits, or the owner did not die
        holding the lock (a start that failed, a pool restart's new image that died before it
        took the lock), which the spare waits on for the next holder."""
        from kvhold.sidecar.instance_lock import spare_takes_over

        if self.spare is None or self.spare.poll() is not None:
            return False
        if not spare_takes_over(self.config.paths, self.spare.pid, self.proc.pid):
            return False
        self.proc, self.spare = self.spare, None
        self.started = now
        self.schedule_spare(now, SPARE_DELAY_S)
        return True

    def exit_reason(self) -> str:
        """' (the reason it gave)' for the owner that exited, or '' if it gave none."""
        reason = self.config.paths.exit_reason(self.proc.pid)
        return f" ({reason})" if reason else ""

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
        if self.spare is not None:     # first: it would take over from the owner's stop otherwise
            self.spare.kill()
            self.spare.wait()
            self.spare = None
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("sidecar pid %d did not stop in %.0f s: SIGKILL", self.proc.pid, timeout)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class FrontendChild:
    """The frontend process (`kvhold frontend`), restarted by `supervise` whenever it dies."""

    def __init__(self, config: ServeConfig):
        self.config = config
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.delay = config.frontend_restart_backoff_s[0]
        self.restart_at: float | None = None
        self.restarts = 0

    def start(self) -> "FrontendChild":
        cmd = [sys.executable, "-m", "kvhold", "frontend", *self.config.sidecar_argv]
        self.proc = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
        self.started = time.monotonic()
        log.info("started the frontend pid %d", self.proc.pid)
        return self

    def watch(self, now: float) -> None:
        """Restart it once it has died (one call per supervisor turn)."""
        code = self.proc.poll() if self.proc is not None else None
        if code is not None and self.restart_at is None:
            if now - self.started >= HEALTHY_RUN_S:
                self.delay = self.config.frontend_restart_backoff_s[0]
            log.error("the frontend pid %d %s after %.1f s: restarting it in %.1f s (the sidecar and "
                      "its executors go on; clients resume their streams)", self.proc.pid,
                      _how_it_ended(code), now - self.started, self.delay)
            self.restart_at = now + self.delay
            self.delay = min(self.delay * 2, self.config.frontend_restart_backoff_s[1])
        if self.restart_at is not None and now >= self.restart_at:
            self.restart_at = None
            self.restarts += 1
            self.start()

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("the frontend pid %d did not stop in %.0f s: SIGKILL", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()


class HttpChild:
    """The HTTP server process (`kvhold serve-http`), on the supervisor's listening socket."""

    def __init__(self, config: ServeConfig, listener: socket.socket):
        self.config, self.listener = config, listener
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        fd = self.listener.fileno()
        cmd = [sys.executable, "-m", "kvhold", "serve-http", "--fd", str(fd)]
        env = dict(os.environ, **{CONFIG_ENV: self.config.to_json()})
        self.proc = subprocess.Popen(cmd, pass_fds=(fd,), env=env, start_new_session=True,
                                     preexec_fn=_killed_with_parent)
        self.started = time.monotonic()
        log.info("started the HTTP server pid %d", self.proc.pid)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(STOP_SIGNAL)       # no drain: closes, streams cut after 5 s (run_http)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("the HTTP server pid %d did not stop in %.0f s: SIGKILL", self.proc.pid, timeout)
            self.proc.kill()
            self.proc.wait()


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP server's listening socket, held by the supervisor across HTTP server restarts."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


class _Signals:
    """SIGTERM/SIGINT, counted, for the supervisor's loop."""

    def __init__(self):
        self.count = 0
        self.name = ""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on)

    def _on(self, sig: int, frame) -> None:
        self.count += 1
        self.name = signal.Signals(sig).name


def supervise(config: ServeConfig, sidecar: SidecarChild | None, http: HttpChild, signals: _Signals,
              frontend: FrontendChild | None = None) -> int:
    """Watch the children (the HTTP server only, with `sidecar` None: --sidecar-endpoint): restart the HTTP server or the frontend when it dies, and the sidecar when it dies
    of anything but a clean stop (a new one re-adopts the executors, which wait for it with
    their memory: kvhold.sidecar.adoption); drain on a signal (the HTTP server first, then the
    sidecar). Exit 1 if the sidecar stops by itself or keeps dying. Returns the exit code."""
    delay = config.http_restart_backoff_s[0]
    restart_at: float | None = None
    sidecar_restart_at: float | None = None
    forwarded = 0               # signals passed on to the HTTP server
    drain_deadline = None
    if http.proc is None:
        http.start()
    while True:
        now = time.monotonic()
        if sidecar is not None and sidecar.exited() and drain_deadline is None:
            code = sidecar.proc.returncode
            if code == 0 or sidecar_restart_at is None and now - sidecar.started < HEALTHY_RUN_S \
                    and sidecar.restarts >= SIDECAR_RESTARTS:
                log.critical("the sidecar %s%s%s: stopping", _how_it_ended(code), sidecar.exit_reason(),
                             "" if code == 0 else f", {sidecar.restarts} restarts within a minute")
                http.stop(10.0)
                return 1
            if sidecar_restart_at is None:
                if now - sidecar.started >= HEALTHY_RUN_S:
                    sidecar.restarts = 0
                dead = sidecar.proc.pid
                if sidecar.take_over(now):
                    sidecar.restarts += 1
                    log.error("the sidecar pid %d %s: the spare pid %d took over (the executors wait "
                              "for it with their memory; the HTTP server's streams resume)", dead,
                              _how_it_ended(code), sidecar.proc.pid)
                    continue
                log.error("the sidecar pid %d %s%s: restarting it (its executors wait for it with "
                          "their memory; the HTTP server's streams resume)", dead, _how_it_ended(code),
                          sidecar.exit_reason())
                sidecar_restart_at = now + SIDECAR_RESTART_DELAY_S * sidecar.restarts
            if now >= sidecar_restart_at:
                sidecar_restart_at = None
                sidecar.restarts += 1
                sidecar.start()
                sidecar.schedule_spare(now, SPARE_DELAY_S)
        if sidecar is not None and drain_deadline is None:
            sidecar.watch_spare(now)
        if frontend is not None and drain_deadline is None:
            frontend.watch(now)
        if signals.count > forwarded:
            if forwarded == 0:
                log.info("%s: draining the HTTP server (at most %.0f s)%s", signals.name,
                         config.drain_timeout_s, ", then the sidecar" if sidecar is not None else "")
                drain_deadline = now + config.drain_timeout_s + 5.0   # + uvicorn's graceful shutdown
            http.signal(signal.SIGTERM)
            forwarded = min(signals.count, 2)
        code = http.poll()
        if code is not None and drain_deadline is not None:
            if code != 0:
                log.warning("the HTTP server %s while draining", _how_it_ended(code))
            return 0
        if code is not None and restart_at is None:
            ran = now - http.started
            if ran >= HEALTHY_RUN_S:
                delay = config.http_restart_backoff_s[0]
            log.error("the HTTP server pid %d %s after %.1f s: restarting it in %.1f s (the sidecar "
                      "keeps its requests for its clients to resume)", http.proc.pid, _how_it_ended(code),
                      ran, delay)
            restart_at = now + delay
            delay = min(delay * 2, config.http_restart_backoff_s[1])
        if restart_at is not None and now >= restart_at:
            restart_at = None
            http.start()
        if drain_deadline is not None and now > drain_deadline:
            log.error("the HTTP server did not finish its drain in time: SIGKILL")
            http.proc.kill()
            http.proc.wait()
            return 0
        time.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains instead of closing the listener at once."""

    def __init__(self, config: uvicorn.Config, gate, drain_timeout_s: float):
        super().__init__(config)
        self.gate, self.drain_timeout_s = gate, drain_timeout_s
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
        if self.drain_deadline is not None:
            return self.gate.idle or time.monotonic() > self.drain_deadline
        return False


def run_serve(config: ServeConfig) -> int:
    """The supervisor: the port, the sidecar and the HTTP server (503 "starting" until the
    sidecar serves), then `supervise`."""
    listener = bind_listener(config.host, config.port)   # refused at once if the port is taken
    if config.sidecar_endpoint is not None:
        return _run_front(config, listener)
    sidecar = SidecarChild(config).start()
    frontend = FrontendChild(config).start()
    http = None
    try:
        http = HttpChild(config, listener)
        http.start()       # the port answers during the start-up: /health is 503 "starting"
        log.info("listening on http://%s:%d while the sidecar starts (instance %r)", config.host,
                 listener.getsockname()[1], config.instance)
        sidecar.wait_until_serving()
        sidecar.schedule_spare(time.monotonic())
        log.info("serving %r on http://%s:%d (sidecar instance %r)", config.served_model_name,
                 config.host, listener.getsockname()[1], config.instance)
        return supervise(config, sidecar, http, _Signals(), frontend)
    finally:
        if http is not None:
            http.stop(10.0)
        sidecar.stop()          # it has the frontend journal the requests in flight, then stops
        frontend.stop()
        listener.close()
        log.info("stopped")


def _run_front(config: ServeConfig, listener: socket.socket) -> int:
    """--sidecar-endpoint: the HTTP server, supervised, in front of a sidecar that runs already."""
    http = None
    try:
        config = front_of_sidecar(config)
        http = HttpChild(config, listener)
        log.info("serving %r on http://%s:%d in front of the sidecar at %s (instance %r)",
                 config.served_model_name, config.host, listener.getsockname()[1], config.sidecar_endpoint,
                 config.instance)
        return supervise(config, None, http, _Signals())
    finally:
        if http is not None:
            http.stop(10.0)
        listener.close()
        log.info("stopped (the sidecar goes on)")


def run_http(config: ServeConfig, fd: int) -> int:
    """The HTTP server process (`kvhold serve-http`): uvicorn on the listening socket `fd`."""
    from kvhold.serving.http_api import AppSettings, create_app

    listener = socket.socket(fileno=fd)
    app = create_app(AppSettings(endpoint=config.endpoint, model_dir=config.model,
                                 served_model_name=config.served_model_name,
                                 context_len=config.context_len, lease_ms=config.lease_ms,
                                 api_key=config.api_key, body_timeout_s=config.guards.body_timeout_s,
                                 routing_id=config.routing_id, sse_keepalive_s=config.sse_keepalive_s,
                                 stream_dir=config.paths.runtime_dir / "http-streams",
                                 max_prompt_bytes=config.max_prompt_bytes, chat_template=config.chat_template,
                                 tool_call_parser=config.tool_call_parser))
    level = (config.uvicorn_log_level or config.log_level).lower()
    server = DrainingServer(uvicorn.Config(app, log_level=level, access_log=config.access_log,
                                           timeout_graceful_shutdown=5, **config.guards.uvicorn_options()),
                            app.state.service.gate, config.drain_timeout_s)
    def stop(sig, frame) -> None:          # uvicorn's own shutdown, without the drain
        server.should_exit = True
    signal.signal(STOP_SIGNAL, stop)
    server.run(sockets=[listener])
    return server.exit_code
