"""The sidecar around a `kvhold.frontend.frontend.Frontend`, for driving one in process.

A frontend talks to its host for four things: replies to clients (`send_client`), a nudge
to the executor (`wake_executor`), the status it reports, and callbacks to run on the
sidecar's loop (`post`: a prompt tokenized, a batch made durable). `FrontendHost` records
the replies and queues the callbacks; a test runs the loop's turns itself, so it decides
when posted work and admissions on disk happen.
"""
from __future__ import annotations

import queue
import time


class FrontendHost:
    def __init__(self):
        self.sent: list[tuple[bytes, object]] = []
        self.posted: queue.SimpleQueue = queue.SimpleQueue()
        self.frontend = None             # the frontend it hosts, set once that is built

    def send_client(self, key, msg):
        self.sent.append((key, msg))

    def wake_executor(self):
        pass

    def status(self):
        return {}

    def post(self, callback):
        self.posted.put(callback)

    def run_posted(self, timeout: float = 10.0) -> None:
        """One loop turn: its posted callbacks (waits for the first), then the frontend's share
        of the turn's deadlines (entering admissions that are on disk)."""
        self.posted.get(timeout=timeout)()
        while not self.posted.empty():
            self.posted.get()()
        self.frontend._admit_ready()

    def reply(self, tag, timeout: float = 10.0):
        """Run loop turns (posted callbacks, then admissions on disk) until `tag` is answered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, msg in self.sent:
                if getattr(msg, "tag", None) == tag:
                    return msg
            try:
                self.posted.get(timeout=0.05)()
            except queue.Empty:
                pass
            self.frontend._admit_ready()
        raise TimeoutError(f"no reply for tag {tag}")
