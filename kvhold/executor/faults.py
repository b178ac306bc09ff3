"""Fault points: real failures at chosen instructions, for crash tests and tools.

`KVHOLD_FAULT="<point>:<n>:<action>[,...]"` makes the executor fail the n-th time
it reaches `point` (1-based), e.g. `commit_pages:3:kill` SIGKILLs itself between
publishing KV page checksums and committing tokens on its third commit. Actions
are real: `kill` (SIGKILL), `segv` (SIGSEGV, default handler), `stop` (SIGSTOP),
`spin` (busy loop forever), `exit` (exit code 3). With `KVHOLD_FAULT_ONCE=<path>`
only the first process to reach its fault fires it (it creates <path> with O_EXCL),
so replacements spawned with the same environment run clean. With
`KVHOLD_FAULT_IF=<path>` a fault fires only while <path> exists, so a test can
let executors start clean, then make every replacement fail. With no variable
set, a fault point costs one dict lookup.

Start-up points: `attached` (lease granted, regions mapped, before the workload
is prepared and Ready is sent).
"""
from __future__ import annotations

import os
import signal

_ACTIONS = ("kill", "segv", "stop", "spin", "exit")
_plan: dict[str, tuple[int, str]] = {}
_hits: dict[str, int] = {}


def parse(spec: str) -> dict[str, tuple[int, str]]:
    plan = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, n, action = item.split(":")
        if action not in _ACTIONS:
            raise ValueError(f"fault action {action!r} not one of {_ACTIONS}")
        plan[point] = (int(n), action)
    return plan


def configure(spec: str | None) -> None:
    _plan.clear()
    _hits.clear()
    if spec:
        _plan.update(parse(spec))


def point(name: str) -> None:
    if not _plan or name not in _plan:
        return
    _hits[name] = _hits.get(name, 0) + 1
    n, action = _plan[name]
    if _hits[name] != n:
        return
    only_if = os.environ.get("KVHOLD_FAULT_IF")
    if only_if and not os.path.exists(only_if):
        return
    once = os.environ.get("KVHOLD_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "segv":
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "spin":
        while True:
            pass
    elif action == "exit":
        os._exit(3)


configure(os.environ.get("KVHOLD_FAULT"))
