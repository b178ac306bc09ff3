"""The sidecar's event loop: one poller over sockets and file descriptors, one thread.

`watch_fd` runs a callback when a descriptor is readable (pidfds, the descriptor
listener); ZeroMQ sockets are `register`ed and their events returned by `poll` for
the owner to drain. `post` hands a callback to the loop thread from any thread
(death watchers, the health monitor): it is queued and a byte on a socket pair
wakes the poll. SIGTERM and SIGINT set `stop_requested` and wake the poll through
the signal wake-up descriptor, so a signal is never lost between two polls.
`close` detaches the signal wake-up and closes the loop's own descriptors.
A *turn* is what the loop does between two polls (callbacks, messages, deadlines);
`turn_ended` times it from the poll's return: everything else that should happen, a
death signal's fencing included, waits that long. Of a turn's time, what the thread
spent runnable but waiting for a CPU (the kernel's schedstat of the loop's thread: other
processes on a busy machine) is told apart from the rest, the *stall*: the time the loop
itself took or waited (for the GIL, a disk, a lock). `stats` (the status's `loop`) says
how many turns ran, the longest turn and stall, how many turns and stalls were over 1,
10 and 100 ms, and the latest turns over 10 ms.
"""
from __future__ import annotations

import collections
import os
import queue
import signal
import socket
import threading
import time
from typing import Callable

import zmq

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
SLOW_TURN_NS = 10_000_000
SLOW_KEPT = 16


class EventLoop:
    def __init__(self):
        self.poller = zmq.Poller()
        self.stop_requested = False
        self._fd_callbacks: dict[int, Callable[[], None]] = {}
        self._posted: queue.SimpleQueue = queue.SimpleQueue()
        self._sig_r, self._sig_w = socket.socketpair()
        self._sig_r.setblocking(False)
        self._sig_w.setblocking(False)
        self._post_r, self._post_w = socket.socketpair()
        self._post_r.setblocking(False)
        signal.set_wakeup_fd(self._sig_w.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        self.watch_fd(self._sig_r.fileno(), self._drain_signals)
        self.watch_fd(self._post_r.fileno(), self._run_posted)
        self._woke_ns = self._woke_wait_ns = 0
        self.turns = 0
        self.max_turn_ns = self.max_stall_ns = 0
        self.over = {1: 0, 10: 0, 100: 0}          # turns longer than so many ms
        self.stalled = {1: 0, 10: 0, 100: 0}       # the same, less their wait for a CPU
        self.slow: collections.deque = collections.deque(maxlen=SLOW_KEPT)
        try:
            self._schedstat = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
        except OSError:
            self._schedstat = None

    def register(self, sock: zmq.Socket) -> None:
        self.poller.register(sock, zmq.POLLIN)

    def watch_fd(self, fd: int, callback: Callable[[], None]) -> None:
        self._fd_callbacks[fd] = callback
        self.poller.register(fd, zmq.POLLIN)

    def unwatch_fd(self, fd: int) -> None:
        if self._fd_callbacks.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def post(self, callback: Callable[[], None]) -> None:
        """Run `callback` on the loop thread soon; safe to call from any thread."""
        self._posted.put(callback)
        try:
            self._post_w.send(b"!")
        except (BlockingIOError, OSError):
            pass  # the loop is already due to wake

    def poll(self, timeout_ms: int) -> dict:
        """Wait up to `timeout_ms`, run the callbacks of readable watched fds, return all events."""
        events = dict(self.poller.poll(timeout_ms))
        self._woke_ns = time.monotonic_ns()
        self._woke_wait_ns = self._cpu_wait_ns()
        for fd in [fd for fd in events if isinstance(fd, int)]:
            callback = self._fd_callbacks.get(fd)
            if callback is not None:
                callback()
        return events

    def _cpu_wait_ns(self) -> int:
        """How long the loop's thread has waited for a CPU, in all (0 where the kernel won't say)."""
        if self._schedstat is None:
            return 0
        try:
            return int(os.pread(self._schedstat, 128, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def turn_ended(self) -> None:
        """The owner's turn is over: time it (from the return of the last poll)."""
        ns = time.monotonic_ns() - self._woke_ns
        self.turns += 1
        self.max_turn_ns = max(self.max_turn_ns, ns)
        if ns <= 1_000_000:
            return
        waited = max(0, self._cpu_wait_ns() - self._woke_wait_ns)
        stall = max(0, ns - waited)
        self.max_stall_ns = max(self.max_stall_ns, stall)
        for ms in self.over:
            self.over[ms] += ns > ms * 1_000_000
            self.stalled[ms] += stall > ms * 1_000_000
        if ns > SLOW_TURN_NS:
            self.slow.append({"ns": self._woke_ns, "ms": round(ns / 1e6, 3),
                              "cpu_wait_ms": round(waited / 1e6, 3)})

    def stats(self) -> dict:
        return {"turns": self.turns, "max_turn_ms": self.max_turn_ns / 1e6,
                "max_stall_ms": self.max_stall_ns / 1e6,
                "turns_over_ms": {str(ms): n for ms, n in self.over.items()},
                "stalls_over_ms": {str(ms): n for ms, n in self.stalled.items()}, "slow": list(self.slow)}

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        if self._schedstat is not None:
            os.close(self._schedstat)
            self._schedstat = None
        for sock in (self._sig_r, self._sig_w, self._post_r, self._post_w):
            sock.close()

    def _run_posted(self) -> None:
        try:
            while self._post_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                callback = self._posted.get_nowait()
            except queue.Empty:
                return
            callback()

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    def _drain_signals(self) -> None:
        try:
            while self._sig_r.recv(64):
                pass
        except BlockingIOError:
            pass
