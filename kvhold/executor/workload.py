"""Workload: what an executor runs, as kvhold.executor.runtime drives it.

The runtime calls, in order: `prepare()` once as a standby-to-be (then reports
`private_mib` and `phases` in Ready); `promote(msg)` once when made active (the
returned report, if any, goes to the sidecar as Recovered; unless `cold_first_step`,
the lease is marked warm at once, else after the first step); then, while active,
`step()` whenever `has_work()`, sending the returned journal slots (and
`take_marks()`, `take_step_tokens()`) as StepDone; `flush()` on a graceful stop; `on_wake()` and
`on_reaped(epochs)` on those sidecar messages. Every workload implements this
protocol; `WorkloadBase` gives the optional parts their defaults.
"""
from __future__ import annotations

from typing import Protocol

from kvhold.protocol import messages as m


class Workload(Protocol):
    private_mib: float          # device memory held beyond the shared regions (Ready)
    phases: dict[str, float]    # warm-up parts in ms (Ready)
    cold_first_step: bool       # the first active step may be slow: keep the start-up lease until then

    def prepare(self) -> None: ...

    def promote(self, msg: m.Promote) -> dict | None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[int]: ...

    def flush(self) -> list[int]: ...

    def take_marks(self) -> dict: ...

    def take_step_tokens(self) -> list[int]: ...

    def on_wake(self) -> None: ...

    def maintain(self) -> None: ...

    def idle(self) -> None: ...

    def on_reaped(self, epochs: list[int]) -> None: ...


class WorkloadBase:
    """The optional parts of a Workload; subclasses implement promote, has_work and step."""

    private_mib: float = 0.0
    cold_first_step: bool = False

    def __init__(self, ctx):
        self.ctx = ctx
        self.phases: dict[str, float] = {}

    def prepare(self) -> None:
        pass

    def promote(self, msg: m.Promote) -> dict | None:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> list[int]:
        raise NotImplementedError

    def flush(self) -> list[int]:
        """Publish what the last step left pending (a graceful stop); the slots it finished."""
        return []

    def take_step_tokens(self) -> list[int]:
        """The tokens each step since the last call computed (none known: [])."""
        return []

    def take_marks(self) -> dict:
        """The first step after a takeover: its parts (ns), once."""
        return {}

    def on_wake(self) -> None:
        pass

    def maintain(self) -> None:
        """The active executor's loop turned (every step, and every heartbeat when idle):
        work the tables ask for outside the requests (a prefix-cache reset)."""

    def idle(self) -> None:
        """A standby's loop woke with nothing to do (every heartbeat): work ahead of a takeover."""

    def on_reaped(self, epochs: list[int]) -> None:
        pass
