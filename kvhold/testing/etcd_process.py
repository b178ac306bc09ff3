"""A throwaway etcd server for tests and benchmarks: loopback, free ports, its own data dir.

    with EtcdProcess(data_dir) as etcd:       # etcd.url == "etcd://127.0.0.1:PORT"
        ...

Uses the `etcd` binary (Debian's etcd-server, 3.4+); `find_etcd()` says where it is or why not.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests

INSTALL_HINT = ("the etcd binary is missing: install Debian's etcd-server "
                "(apt-get install -y --no-install-recommends etcd-server), or set "
                "KVHOLD_SKIP_ETCD=1 to skip the registry tests")


def find_etcd() -> str | None:
    return shutil.which("etcd") or next((p for p in ("/usr/bin/etcd", "/usr/local/bin/etcd")
                                         if os.access(p, os.X_OK)), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdProcess:
    def __init__(self, data_dir: Path, log_path: Path | None = None):
        self.binary = find_etcd()
        if self.binary is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.data_dir = Path(data_dir)
        self.log_path = log_path or self.data_dir.with_suffix(".log")
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"etcd://127.0.0.1:{self.client_port}"

    def start(self, timeout: float = 15.0) -> "EtcdProcess":
        client, peer = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        cmd = [self.binary, "--name", "kvhold-test", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", f"kvhold-test={peer}", "--log-level", "warn"]
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if requests.get(f"{client}/health", timeout=0.5).json().get("health") == "true":
                    return self
            except (requests.RequestException, ValueError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"etcd did not become healthy in {timeout} s; see {self.log_path}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
