"""`kvhold top` and `kvhold status --json` against a real sidecar, and the page map they show."""
import fcntl
import json
import os
import pty
import select
import signal
import struct
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
from rich.console import Console

from kvhold.protocol.layout import PAGE_DTYPE, PageFlag
from kvhold.protocol.page_map import page_map
from kvhold.cli.top import render
from tests.process.helpers import wait_stopped

# The active executor stops itself (SIGSTOP) at its 20th step, its request in flight and its
# pages committed; the long lease keeps it unfenced while we look, then we SIGKILL it.
FLAGS = ["--max-seq-len", "256", "--standbys", "1", "--lease-ms", "5000"]
STOP_AT_STEP = 20


def _cli(sc, *args):
    return subprocess.run([sys.executable, "-m", "kvhold", *args, "--instance", sc.instance,
                           "--runtime-root", str(sc.runtime_root)],
                          capture_output=True, text=True, timeout=30)


def _frame(status, width=140) -> str:
    console = Console(record=True, width=width, force_terminal=False)
    console.print(render(status))
    return console.export_text()


@pytest.fixture(scope="module")
def sidecar_flags(tiny_model):
    return ["--model", str(tiny_model), *FLAGS]


@pytest.fixture(scope="module")
def sidecar_env(tmp_path_factory):
    return {"KVHOLD_FAULT": f"commit_finish:{STOP_AT_STEP}:stop",
            "KVHOLD_FAULT_ONCE": str(tmp_path_factory.mktemp("fault") / "fired")}


def test_page_map_cells_and_downsampling():
    snap = np.zeros(12, dtype=PAGE_DTYPE)
    snap["owner"][2:6] = 7                      # committed
    snap["flags"][6] = PageFlag.QUARANTINED
    snap["owner"][8] = 7
    snap["version"][8] = 3                      # a write in progress
    snap["owner"][10] = 9
    snap["flags"][10] = PageFlag.BAD
    assert page_map(snap) == {"pages_per_cell": 1, "cells": "..####q.w.x."}
    # two pages a cell: rare states win, mixed free/committed is "partly"
    assert page_map(snap, max_cells=6) == {"pages_per_cell": 2, "cells": ".##qwx"}
    assert page_map(snap, max_cells=4)["cells"] == "+#wx"


def test_top_shows_executors_pages_and_a_recovery(sidecar):
    status = sidecar.status()
    active = sidecar.executors(status, "active")[0]
    with sidecar.new_client(timeout=30) as client:
        stream = client.generate("The pool is drawn as a heatmap", max_tokens=200, temperature=0.0,
                                 ignore_eos=True)
        wait_stopped(active["pid"])
        try:
            status = sidecar.status()
            frame = _frame(status)
        finally:
            os.kill(active["pid"], signal.SIGKILL)   # and crash it: the standby takes over
        result = stream.result()
    assert result.completion_tokens == 200
    for ex in status["executors"]:
        assert str(ex["pid"]) in frame
    assert "active" in frame and "standby" in frame
    pages = status["pages"]
    assert pages["committed"] > 0 and f"committed {pages['committed']}" in frame
    assert f"total {pages['total']}" in frame
    assert len(status["page_map"]["cells"]) == pages["total"]
    assert set(status["page_map"]["cells"]) & set("+#")

    rec = sidecar.wait_for(lambda st: next(
        (r for r in st["recoveries"] if r["fenced_epoch"] == active["epoch"]), None))
    assert rec["requests_resumable"] + rec["requests_damaged"] >= 1
    out = _cli(sidecar, "top", "--once")
    assert out.returncode == 0, out.stderr
    assert f"{active['epoch']}→{rec['epoch']}" in out.stdout
    assert "recoveries (ms after detection)" in out.stdout and "KV page pool" in out.stdout
    assert str(rec["pid"]) in out.stdout


def _read_until(fd, needle: bytes | tuple[bytes, ...], timeout_s: float) -> bytes:
    """What the terminal shows until every needle has appeared (a frame may arrive in pieces)."""
    needles = (needle,) if isinstance(needle, bytes) else needle
    out, deadline = b"", time.monotonic() + timeout_s
    while not all(n in out for n in needles) and time.monotonic() < deadline:
        if select.select([fd], [], [], 0.2)[0]:
            try:
                out += os.read(fd, 65536)
            except OSError:
                break
    return out


def test_live_top_marks_a_silent_sidecar_stale_and_quits_on_q(sidecar):
    """On a terminal: frames at the interval; a sidecar that stops answering leaves the last
    frame, marked stale; `q` ends top with status 0 (and the terminal mode restored)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    saved = termios.tcgetattr(slave)
    top = subprocess.Popen([sys.executable, "-m", "kvhold", "top", "--interval", "0.2", "--timeout", "0.5",
                            "--instance", sidecar.instance, "--runtime-root", str(sidecar.runtime_root)],
                           stdin=slave, stdout=slave, stderr=slave, env={**os.environ, "NO_COLOR": "1"})
    try:
        assert b"KV page pool" in _read_until(master, b"KV page pool", 30)
        os.kill(sidecar.proc.pid, signal.SIGSTOP)
        try:
            shown = _read_until(master, (b"STALE: the sidecar has not answered for", b"executors"), 20)
        finally:
            os.kill(sidecar.proc.pid, signal.SIGCONT)
        assert b"STALE: the sidecar has not answered for" in shown and b"executors" in shown
        os.write(master, b"q")
        assert top.wait(timeout=10) == 0
        assert termios.tcgetattr(slave)[3] == saved[3]       # cbreak undone: echo, canonical mode
    finally:
        if top.poll() is None:
            top.kill()
        os.close(master)
        os.close(slave)


def test_status_json_for_scripts(sidecar):
    out = _cli(sidecar, "status", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert {"executors", "pages", "page_map", "recoveries", "events", "weights",
            "requests"} <= status.keys()
    assert status["pid"] == sidecar.proc.pid
    assert status["pages"]["total"] == len(status["page_map"]["cells"])


def test_top_once_without_a_sidecar_fails_cleanly(runtime_root):
    out = subprocess.run([sys.executable, "-m", "kvhold", "top", "--once", "--instance", "nobody",
                          "--runtime-root", str(runtime_root), "--timeout", "0.3"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1
    assert "no message from the sidecar" in out.stdout + out.stderr
