"""Run a real `kvhold sidecar` as a child process: for tools, the demo and tests.

Starts the sidecar with the given flags in its own runtime root, waits until it
answers a ping, and offers the few things callers need: status, waiting for a
condition on the status, the active executor's pid, and a clean or brutal stop.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvhold.client.client import Client
from kvhold.protocol.errors import KvholdError
from kvhold.testing.shm import remove_instance_shm


class SidecarProcess:
    def __init__(self, args: list[str], instance: str | None = None, runtime_root: Path | None = None,
                 env: dict | None = None, log_path: Path | None = None, prefix: list[str] | None = None):
        self.instance = instance or f"t{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self._own_root = runtime_root is None
        self.runtime_root = Path(runtime_root or tempfile.mkdtemp(prefix="kvh-"))
        self.args = args
        self.env = dict(os.environ, **(env or {}))
        self.log_path = log_path
        self.prefix = list(prefix or [])   # a command that execs the sidecar (e.g. in a mount namespace)
        self.proc: subprocess.Popen | None = None
        self._client: Client | None = None
        _made.append(self)

    def start(self, timeout: float = 60.0) -> "SidecarProcess":
        return self.spawn().wait_serving(timeout)

    def spawn(self, extra: list[str] = ()) -> "SidecarProcess":
        """Start the process and return at once (a spare, `extra=["--spare"]`, answers only
        once it has taken over: `wait_serving`)."""
        cmd = [*self.prefix, sys.executable, "-m", "kvhold", "sidecar", "--instance", self.instance,
               "--runtime-root", str(self.runtime_root), *self.args, *extra]
        out = open(self.log_path, "ab") if self.log_path else None
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=out, start_new_session=True)
        return self

    def wait_serving(self, timeout: float = 60.0) -> "SidecarProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sidecar exited with code {self.proc.returncode} during start-up")
            try:
                if self.client.status()["pid"] == self.proc.pid:  # ours, not a namesake
                    return self
            except KvholdError:
                pass
            time.sleep(0.02)
        raise TimeoutError("sidecar did not answer within the start-up timeout")

    def spare(self, log_path: Path | None = None, timeout: float = 60.0, env: dict | None = None) -> "SidecarProcess":
        """A spare of this sidecar (`kvhold sidecar --spare`, same flags; `env` added to this
        one's environment), returned once it waits on this sidecar's lock."""
        other = SidecarProcess(self.args, instance=self.instance, runtime_root=self.runtime_root,
                               env={**self.env, **(env or {})}, log_path=log_path or self.log_path,
                               prefix=self.prefix)
        other.spawn(["--spare"])
        marker = other.paths.spare_file(other.proc.pid)
        deadline = time.monotonic() + timeout
        while not (marker.exists() and marker.read_text().strip() == str(self.proc.pid)):
            if other.proc.poll() is not None:
                raise RuntimeError(f"spare sidecar exited with code {other.proc.returncode} while starting")
            if time.monotonic() > deadline:
                other.proc.kill()
                raise TimeoutError("the spare sidecar did not start waiting within the timeout")
            time.sleep(0.02)
        return other

    @property
    def paths(self):
        from kvhold.protocol.naming import InstancePaths

        return InstancePaths.for_instance(self.instance, self.runtime_root)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client.for_instance(self.instance, self.runtime_root, timeout=2.0)
        return self._client

    def new_client(self, timeout: float = 10.0) -> Client:
        return Client.for_instance(self.instance, self.runtime_root, timeout=timeout)

    def status(self) -> dict:
        return self.client.status()

    def wait_for(self, predicate, timeout: float = 30.0, interval: float = 0.02):
        """Poll status until predicate(status) is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate(self.status())
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError("condition not reached in time")
            time.sleep(interval)

    @staticmethod
    def executors(status: dict, role: str) -> list[dict]:
        return [e for e in status["executors"] if e["role"] == role]

    def wait_steady(self, standbys: int = 1, timeout: float = 60.0) -> dict:
        """Wait for one active executor and `standbys` ready standbys; returns the active one."""
        def steady(st):
            active = self.executors(st, "active")
            ready = [e for e in self.executors(st, "standby") if e["ready"]]
            return active[0] if len(active) == 1 and len(ready) >= standbys else None
        return self.wait_for(steady, timeout)

    def events(self, kind: str | None = None) -> list[dict]:
        return [e for e in self.status()["events"] if kind is None or e["kind"] == kind]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        code = self.proc.returncode
        if sig == signal.SIGKILL:  # executors die with their sidecar (PDEATHSIG); reap the group
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return code

    @property
    def killed(self) -> bool:
        """It ended by a signal it does not handle (a test's SIGKILL): its shm objects stay for
        re-adoption, and executors of its process group may outlive it."""
        return self.proc is not None and self.proc.returncode is not None and self.proc.returncode < 0

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        clean_up_killed()
        if self._own_root:
            import shutil
            shutil.rmtree(self.runtime_root, ignore_errors=True)


_made: list[SidecarProcess] = []      # every SidecarProcess not yet known to have ended


def clean_up_killed() -> list[str]:
    """What killed sidecars left: a sidecar that ended by a signal (a test's SIGKILL) leaves its
    shm objects for a successor to re-adopt, and executors of its process group may wait for
    one. For each such sidecar with no sidecar of its instance still running, kill what is left
    of its process group and unlink its instance's shm objects (kvhold.testing.shm). The process
    tests call it after each test; returns the names unlinked."""
    running = {sc.instance for sc in _made if sc.proc is not None and sc.proc.poll() is None}
    removed = []
    for sc in list(_made):
        if sc.proc is None or sc.proc.returncode is None or sc.instance in running:
            continue
        _made.remove(sc)
        if sc.killed:
            try:
                os.killpg(sc.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            removed += remove_instance_shm(sc.instance)
    return removed


def submit_requests(client, requests) -> list:
    """Start every request (dicts of generate() arguments; "prompt" text or "prompt_ids")."""
    out = []
    for r in requests:
        r = dict(r)
        prompt = r.pop("prompt", None)
        out.append(client.generate(prompt, **r) if prompt else client.generate(**r))
    return out
