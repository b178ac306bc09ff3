"""A memory owner (`kvhold sidecar --external-frontend`) and its frontend process
(`kvhold frontend`) as real processes, for tests: the same instance and flags for both."""
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


class SplitProcesses:
    def __init__(self, args: list[str], instance: str | None = None, runtime_root: Path | None = None,
                 log_dir: Path | None = None, env: dict | None = None):
        self.instance = instance or f"s{os.getpid()}-{time.monotonic_ns() % 10**6}"
        self.runtime_root = Path(runtime_root or tempfile.mkdtemp(prefix="kvh-"))
        self.args = ["--instance", self.instance, "--runtime-root", str(self.runtime_root), *args]
        self.log_dir = log_dir
        self.env = dict(os.environ, **(env or {}))
        self.owner: subprocess.Popen | None = None
        self.frontend: subprocess.Popen | None = None
        self.frontends_started = 0

    def _popen(self, what: list[str], log_name: str) -> subprocess.Popen:
        out = open(self.log_dir / log_name, "ab") if self.log_dir else None
        return subprocess.Popen([sys.executable, "-m", "kvhold", *what, *self.args], stdout=out, stderr=out,
                                env=self.env, start_new_session=True)

    def start(self, timeout: float = 60.0) -> "SplitProcesses":
        self.owner = self._popen(["sidecar", "--external-frontend"], "owner.log")
        self.start_frontend()
        self.wait_serving(timeout)
        return self

    def start_frontend(self) -> None:
        self.frontends_started += 1
        self.frontend = self._popen(["frontend"], f"frontend-{self.frontends_started}.log")

    def wait_serving(self, timeout: float = 60.0) -> dict:
        """The status once the frontend answers for this owner."""
        deadline = time.monotonic() + timeout
        with self.new_client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                for name, proc in (("sidecar", self.owner), ("frontend", self.frontend)):
                    if proc.poll() is not None:
                        raise RuntimeError(f"the {name} exited with code {proc.returncode}")
                try:
                    status = client.status()
                    if status["pid"] == self.owner.pid and status["frontend"]["pid"] == self.frontend.pid:
                        return status
                except KvholdError:
                    pass
                time.sleep(0.05)
        raise TimeoutError("the split sidecar did not answer within the start-up timeout")

    def new_client(self, timeout: float = 10.0) -> Client:
        return Client.for_instance(self.instance, self.runtime_root, timeout=timeout)

    def status(self) -> dict:
        with self.new_client(timeout=5.0) as client:
            return client.status()

    def stop(self, timeout: float = 20.0) -> tuple[int | None, int | None]:
        """SIGTERM the owner (it has the frontend journal what is in flight), then the frontend."""
        codes = []
        for proc in (self.owner, self.frontend):
            if proc is None:
                codes.append(None)
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            codes.append(proc.returncode)
        return tuple(codes)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
