"""The internal channel between the memory owner (`kvhold sidecar --external-frontend`) and
the client-facing frontend process (`kvhold frontend`), as typed wire messages.

The two processes share the tables (the frontend maps them by name: it writes the
journal's admission half, reads the committed tokens and releases finished slots, as the
in-process frontend does); this channel carries only what the tables do not:

    frontend -> owner                         owner -> frontend
    hello (every HELLO_INTERVAL_S)  ------->  owner_hello (pid, pool generation, the
                                              admission closures it holds, the requests
                                              it failed that are still in the journal)
    wake_executor (new work, a cancel) --->   (a Wake to the active executor)
    owner_status_query (tag) ------------->   owner_status (tag, its status)
    admissions_query (tag, reopen) ------->   admissions_answer (tag, closures)
                                              committed (slots): a step committed tokens
                                              fail_request (query of death, section 8)
                                              admissions_changed (closures: health)
                                              executors_stopped: a stop; journal what is
    in_flight_journaled (n) <--------------   in flight to disk, then answer
    pool_restart_asked (hold) ------------>   (stop the executors, executors_stopped,
                                              then re-execute into the next generation)

The owner parses nothing a client sent: no prompt, no token stream, no client identity.
A frontend that restarts says hello again and gets the whole state (closures, failed
requests) in the reply; one whose pool is gone (another generation in `owner_hello`: a
pool restart, or an owner that could not adopt) re-executes itself to serve the new pool. A restarted owner (re-adopting the
pool) is greeted by the same frontend's next hello.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvhold.protocol.wire import message

HELLO_INTERVAL_S = 0.2
EXIT_POOL_GONE = 3          # a frontend whose pool was replaced leaves its loop with this (then re-executes)


# ------------------------------------------------------------------ frontend -> memory owner


@message("hello")
class Hello:
    pid: int
    generation: int = 0        # the pool the frontend serves (0: none mapped yet)


@message("wake_executor")
class WakeExecutor:
    pass


@message("owner_status_query")
class OwnerStatusQuery:
    tag: int


@message("admissions_query")
class AdmissionsQuery:
    tag: int
    reopen: bool = False


@message("in_flight_journaled")
class InFlightJournaled:
    requests: int


@message("pool_restart_asked")
class PoolRestartAsked:
    """A local operator asked the frontend for a pool restart (`kvhold pool-restart`); its
    clients are told. The owner stops its executors, has the frontend journal what is in
    flight (`executors_stopped`), and re-executes itself into a pool of the next generation."""
    hold: bool = False


# ------------------------------------------------------------------ memory owner -> frontend


@message("owner_hello")
class OwnerHello:
    pid: int
    generation: int
    tables: str                                   # the tables' shm name
    closed: dict = dataclasses.field(default_factory=dict)     # who closed admissions -> why
    failed: list[Any] = dataclasses.field(default_factory=list)     # [request id, slot, message]


@message("owner_status")
class OwnerStatus:
    tag: int
    status: dict


@message("admissions_answer")
class AdmissionsAnswer:
    tag: int
    closed: dict


@message("committed")
class Committed:
    """Tokens were committed to the journal for these slots (an executor's StepDone)."""
    slots: list[int]
    recoveries: int = 0        # takeovers the owner's timeline has recorded (its stats line's count)


@message("fail_request")
class FailRequest:
    request_id: int
    slot: int
    message: str


@message("admissions_changed")
class AdmissionsChanged:
    closed: dict


@message("executors_stopped")
class ExecutorsStopped:
    pass


TO_OWNER = frozenset({"hello", "wake_executor", "owner_status_query", "admissions_query",
                      "in_flight_journaled", "pool_restart_asked"})
TO_FRONTEND = frozenset({"owner_hello", "owner_status", "admissions_answer", "committed",
                         "fail_request", "admissions_changed", "executors_stopped"})


def link_socket(paths):
    """The channel's socket file in the instance's 0700 runtime directory."""
    return paths.runtime_dir / "frontend-link.sock"


def link_endpoint(paths) -> str:
    return f"ipc://{link_socket(paths)}"
