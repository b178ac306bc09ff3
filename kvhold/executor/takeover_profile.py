"""Where a promoted executor's device time goes: a profile of the takeover and its first steps.

`KVHOLD_PROFILE_TAKEOVER=FILE` (a diagnostic, for tools/h200_run.sh and people chasing recovery
time): an executor promoted after a failover profiles, with torch.profiler, the takeover and
the steps numbered in PROFILED_STEPS after it, each apart, and appends to FILE each one's
wall time and its device kernels by total time. The profiler's own start and stop add
milliseconds to the recovery it watches, so the recovery figures of a profiled run are not
the product's; the kernel durations are what it is for (a first step's against a later
step's, the validation pass's against its bandwidth floor). A standby starts and stops the
profiler once while it warms up, so that its first use in a takeover does not load CUPTI.
"""
from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager

log = logging.getLogger(__name__)

ENV = "KVHOLD_PROFILE_TAKEOVER"
PROFILED_STEPS = (1, 2, 4)     # steps after a takeover to profile (1: the first resumed step)
ROWS = 25                      # kernels listed per profiled part


def target() -> str | None:
    return os.environ.get(ENV) or None


def warm_up() -> None:
    """Load the profiler's CUDA tracing ahead, if profiling is asked for."""
    if target() is None:
        return
    import torch
    with torch.profiler.profile(activities=_activities()):
        torch.zeros(1, device="cuda" if torch.cuda.is_available() else "cpu").add_(1)


def _activities():
    import torch
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


class TakeoverProfile:
    """Profiles the takeover and the steps after it named in PROFILED_STEPS."""

    def __init__(self, path: str, pid: int):
        self.path = path
        self.pid = pid
        self.steps_after = None          # steps run since the profiled takeover, None: none

    @contextmanager
    def part(self, label: str):
        import torch
        t0 = time.perf_counter_ns()
        with torch.profiler.profile(activities=_activities()) as prof:
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        wall_ms = (time.perf_counter_ns() - t0) / 1e6
        try:
            self._write(label, wall_ms, prof)
        except Exception as exc:           # a diagnostic must never cost the takeover
            log.warning("takeover profile not written: %s", exc)

    def _write(self, label: str, wall_ms: float, prof) -> None:
        import torch
        if torch.cuda.is_available():    # device kernels by their time on the GPU
            events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            time_of = lambda e: e.device_time_total       # noqa: E731
        else:                            # on CPU, operators by their own CPU time
            events = list(prof.key_averages())
            time_of = lambda e: e.self_cpu_time_total     # noqa: E731
        events = [e for e in events if time_of(e) > 0]
        events.sort(key=time_of, reverse=True)
        total_us = sum(time_of(e) for e in events)
        lines = [f"== pid {self.pid} {label}: wall {wall_ms:.2f} ms, kernels {total_us / 1e3:.2f} ms "
                 f"({sum(e.count for e in events)} launches)"]
        for e in events[:ROWS]:
            lines.append(f"  {time_of(e) / 1e3:9.3f} ms  {e.count:5d} x  {e.key[:110]}")
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")

    def step(self):
        """A context for the next step: a profiled part if it is one of PROFILED_STEPS."""
        if self.steps_after is None:
            return _nothing()
        self.steps_after += 1
        n = self.steps_after
        if n > max(PROFILED_STEPS):
            self.steps_after = None
        if n in PROFILED_STEPS:
            return self.part(f"step {n} after the takeover")
        return _nothing()


@contextmanager
def _nothing():
    yield
