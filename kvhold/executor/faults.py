"""Fault points: real failures at chosen instructions, for crash tests and tools.

`KVHOLD_FAULT="<point>:<n>:<action>[,...]"` makes the executor fail the n-th time
it reaches `point` (1-based), e.g. `commit_pages:3:kill` SIGKILLs itself between
publishing KV page checksums and committing tokens on its third commit. Actions
are real: `kill` (SIGKILL), `segv` (SIGSEGV, default handler), `stop` (SIGSTOP),
`spin` (busy loop forever), `exit` (exit code 3), and `cuda_illegal`: a kernel in
the executor's own CUDA context overwrites the start of some KV pages (the ones the
point names, see kvhold.executor.cuda.faults) and then stores to an illegal address,
the classic engine crash (Xid 13/31/43). The fault is asynchronous, as a real one is:
the step goes on until its next synchronisation raises, and the context is lost.
`cuda_illegal` fires only where a point passes its target (the CUDA decode step,
`decode_queued`).

A fault fires at the n-th hit or, if it could not fire then, at the first hit after.
With `KVHOLD_FAULT_ONCE=<path>` only the first process to reach its fault fires it
(it creates <path> with O_EXCL and writes its pid and CLOCK_MONOTONIC ns there), so
replacements spawned with the same environment run clean; creating <path> beforehand
disarms the fault, removing it arms it again. With `KVHOLD_FAULT_IF=<path>` a fault
fires only while <path> exists, so a test can let executors start clean, then make
every replacement fail. With no variable set, a fault point costs one dict lookup.

Start-up points: `attached` (lease granted, regions mapped, before the workload
is prepared and Ready is sent). Takeover points (kvhold.executor.takeover): `takeover_cleared`
(the pages no request keeps released or quarantined) and `takeover_tails` (the partially
filled tails placed), both before the requests are resumed. `publish_counts`: inside a
page publish (kvhold.protocol.page_table), the new counts written and not yet the checksums.
The vLLM bridge (kvhold.vllm_bridge.workload) reaches `commit_pages` once per request output
with new tokens, its KV mirrored and nothing of it journaled yet (counted, or conditioned on that
request's submitted tokens), and `step` once per vLLM step, before it, conditioned on the
submitted tokens of its live requests.

Request-conditioned points fire on what is in a step rather than on a count:
`<point>:token=<id>:<action>` fires each time `point` is reached with a request whose prompt
holds token id `<id>`, in every executor (a request that kills whichever executor runs it, a
"query of death"), unless KVHOLD_FAULT_ONCE limits it to the first; `token=<id>@<n>` fires
from the n-th such hit on (counted while KVHOLD_FAULT_IF's file exists, where it is set), so a
test can stop an executor a set number of steps into one request's life, whenever that request
arrives. The engine reaches the
`step` point once per step, after naming the step's requests in the journal and before the
forward (kvhold.executor.engine), e.g. `KVHOLD_FAULT="step:token=7:kill"`.
"""
from __future__ import annotations

import os
import signal
import time

from kvhold.protocol import page_table

_ACTIONS = ("kill", "segv", "stop", "spin", "exit", "cuda_illegal")
_plan: dict[str, tuple[int, str]] = {}
_on_token: dict[str, tuple[int, int, str]] = {}      # point -> (prompt token id, from hit n, action)
_hits: dict[str, int] = {}


def parse(spec: str) -> tuple[dict[str, tuple[int, str]], dict[str, tuple[int, int, str]]]:
    """(counted points, request-conditioned points) of a KVHOLD_FAULT value."""
    plan, on_token = {}, {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        point, when, action = item.split(":")
        if action not in _ACTIONS:
            raise ValueError(f"fault action {action!r} not one of {_ACTIONS}")
        if when.startswith("token="):
            token, _, n = when[len("token="):].partition("@")
            on_token[point] = (int(token), int(n or 1), action)
        else:
            plan[point] = (int(when), action)
    return plan, on_token


def configure(spec: str | None) -> None:
    _plan.clear()
    _on_token.clear()
    _hits.clear()
    if spec:
        plan, on_token = parse(spec)
        _plan.update(plan)
        _on_token.update(on_token)
    # inside PageTable.publish, between a page's new count and its new checksum
    page_table.between_count_and_checksum = (lambda: point("publish_counts")) if "publish_counts" in _plan else None


def point(name: str, target=None) -> None:
    """`target()` gives what an action acts on where one needs it: (KV pool, pages)."""
    if not _plan or name not in _plan:
        return
    _hits[name] = _hits.get(name, 0) + 1
    n, action = _plan[name]
    if _hits[name] < n:
        return
    _fire(name, action, target)


def batch_point(name: str, prompts) -> None:
    """A request-conditioned point: `prompts` are the prompt token ids of the step's requests."""
    if not _on_token or name not in _on_token:
        return
    token, n, action = _on_token[name]
    only_if = os.environ.get("KVHOLD_FAULT_IF")
    if only_if and not os.path.exists(only_if):
        return                         # disarmed: steps are counted from the arming on
    if any(token in prompt for prompt in prompts):
        key = f"{name}:token"
        _hits[key] = _hits.get(key, 0) + 1
        if _hits[key] >= n:
            _fire(name, action, None)


def _fire(name: str, action: str, target) -> None:
    only_if = os.environ.get("KVHOLD_FAULT_IF")
    if only_if and not os.path.exists(only_if):
        return
    once = os.environ.get("KVHOLD_FAULT_ONCE")
    if once:
        try:
            fd = os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return
        os.write(fd, f"{os.getpid()} {time.monotonic_ns()}\n".encode())   # who fired, and when
        os.close(fd)
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
    elif action == "cuda_illegal":
        if target is None:
            raise RuntimeError(f"fault point {name!r} has no CUDA target for cuda_illegal")
        from kvhold.executor.cuda.faults import scribble_then_fault
        scribble_then_fault(*target())


configure(os.environ.get("KVHOLD_FAULT"))
