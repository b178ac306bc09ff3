"""Run a real `kvhold serve` as a child process: for tests and the benchmarks in tools/.

Starts the server (its supervisor, sidecar, executors and HTTP server, or only the HTTP side
with `--sidecar-endpoint`) on a free loopback port, waits until /health answers 200 with
the standbys asked for, and offers what callers need: /health, a POST, an OpenAI client,
the sidecar's status, the pid of one of its children, and the stream of server-sent events
of a response. `stop` sends SIGTERM, waits for the drain, and kills what is left.
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvhold.client.client import Client
from kvhold.testing.etcd_process import free_port


@functools.cache
def http_client() -> httpx.Client:
    """The HTTP client of this process's polls and posts to servers. Making an httpx client
    builds an SSL context (about 30 ms of CPU): `httpx.get` makes one per call, which a health
    poll every 50 ms paid each time. Each request still opens a connection of its own (no
    keep-alive), as `httpx.get` does, so a restarted server is never asked over a dead one."""
    return httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))


class ServeProcess:
    """`kvhold serve [--model MODEL] --port P --runtime-root ROOT [--instance I] *flags`.

    With a model and no instance, the instance is named after this process and the port, so
    that servers side by side never share one; without a model (`--sidecar-endpoint`), no
    instance is named. `new_session`: the server leads a process group of its own, and a
    server that does not stop on SIGTERM is killed with its whole group."""

    def __init__(self, flags, runtime_root: Path, *, model: Path | None = None, instance: str | None = None,
                 api_key: str | None = None, log_path: Path | None = None, env: dict | None = None,
                 new_session: bool = False, preexec_fn=None, cwd: Path | None = None):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.runtime_root = Path(runtime_root)
        self.instance = instance or (f"http{os.getpid()}-{self.port}" if model is not None else None)
        self.api_key = api_key
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.cmd = [sys.executable, "-m", "kvhold", "serve", *(["--model", str(model)] if model is not None else []),
                    "--port", str(self.port), "--runtime-root", str(self.runtime_root),
                    *(["--instance", self.instance] if self.instance else []), *flags,
                    *(["--api-key", api_key] if api_key else [])]
        self.log_path = log_path
        self.env = None if env is None else dict(os.environ, **env)
        self.new_session = new_session
        self.preexec_fn = preexec_fn
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self._log = None

    # ------------------------------------------------------------------ life cycle
    def spawn(self) -> "ServeProcess":
        """Start the process and return at once."""
        self._log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=self._log, env=self.env,
                                     start_new_session=self.new_session, preexec_fn=self.preexec_fn,
                                     cwd=self.cwd)
        return self

    def start(self, standbys: int = 1, timeout: float = 90.0) -> "ServeProcess":
        """Spawn, then wait until healthy with `standbys` standbys ready; stopped if it is not."""
        self.spawn()
        try:
            self.wait_healthy(standbys, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the drain), then a kill after `timeout` s; the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                if self.new_session:
                    os.killpg(self.proc.pid, signal.SIGKILL)    # the server's own group: all of it
                else:
                    self.proc.kill()
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._log = None
        return self.proc.returncode

    def __enter__(self):
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ HTTP
    def health(self) -> httpx.Response:
        try:
            return http_client().get(self.base + "/health", timeout=5)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # a kept-alive connection the server closed meanwhile (a drain closes the idle ones):
            # asked again on a connection of its own
            return httpx.get(self.base + "/health", timeout=5)

    def get_health(self) -> dict | None:
        """/health's body when it answers 200, else None (also when it does not answer)."""
        try:
            r = self.health()
            return r.json() if r.status_code == 200 else None
        except (httpx.TransportError, ValueError):
            return None

    def wait_healthy(self, standbys: int = 1, timeout: float = 90.0, interval: float = 0.05) -> dict:
        """/health's body once it answers 200 (an active executor serves) with `standbys`
        standbys ready; a server that exits meanwhile raises at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvhold serve exited with {self.proc.returncode} (log: {self.log_path})")
            h = self.get_health()
            if h is not None and h.get("standbys_ready", 0) >= standbys:
                return h
            time.sleep(interval)
        raise TimeoutError(f"kvhold serve not healthy with {standbys} standbys in {timeout:.0f} s")

    def post(self, path: str, body, **kw) -> httpx.Response:
        return http_client().post(self.base + path, json=body, headers=self.headers, timeout=60, **kw)

    def openai(self, timeout: float = 60.0):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "none", max_retries=0,
                             timeout=timeout)

    # ------------------------------------------------------------------ processes
    def sidecar_status(self, timeout: float = 5.0) -> dict:
        with Client.for_instance(self.instance, self.runtime_root, timeout=timeout) as c:
            return c.status()

    def child(self, marker: str) -> int | None:
        """The pid of the live child whose command names `marker` among its first words
        ("serve-http", "sidecar", "frontend"), or None."""
        want = marker.encode()
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            for pid in open(f"/proc/{self.proc.pid}/task/{task}/children").read().split():
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
                    state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]
                except FileNotFoundError:
                    continue
                if want in cmd[:4] and state != "Z":
                    return int(pid)
        return None


class Events:
    """The complete server-sent events read from a streamed response: (id or None, data), and
    with a `clock`, (id or None, data, clock() when the event was read)."""

    def __init__(self, response: httpx.Response, clock=None):
        self.lines = response.iter_lines()
        self.events: list[tuple] = []
        self.clock = clock
        self._id = self._data = None

    def read(self, n: int | None = None) -> "Events":
        """Read `n` more events (all, up to the end or a broken connection, when None)."""
        want = None if n is None else len(self.events) + n
        try:
            for line in self.lines:
                if line.startswith("id: "):
                    self._id = line[4:]
                elif line.startswith("data: "):
                    self._data = line[6:]
                elif line == "" and self._data is not None:
                    self.events.append((self._id, self._data) if self.clock is None
                                       else (self._id, self._data, self.clock()))
                    self._id = self._data = None
                    if want is not None and len(self.events) >= want:
                        break
        except httpx.TransportError:
            pass              # the server was killed: what came before is all there is
        return self


def comparable(events) -> list:
    """What must equal between two runs of one request: each event's number and content."""
    out = []
    for event_id, data, *_ in events:
        if data == "[DONE]":
            out.append((event_id, data))
            continue
        obj = json.loads(data)
        out.append((event_id.rsplit("-", 1)[1], obj["choices"], obj.get("usage"), obj["object"]))
    return out
