"""Every message kvhold processes exchange, as typed wire structs (see ipc.wire).

Two sockets, two vocabularies:
* control (executor <-> sidecar): attach/attached, ready, weights_*, step, recovered,
  bye; and from the sidecar: promote, wake, reaped, shutdown.
* client (SDK <-> sidecar): generate/accepted, tokens, done, cancel/cancelled,
  status/status_reply, ping/pong, keepalive.
Both use `error` (code from ipc.errors.ErrorCode). Client requests carry a `tag`
chosen by the client and echoed in the reply, so replies can be matched.
"""
from __future__ import annotations

import dataclasses

from ipc.wire import message

# ------------------------------------------------------------------ shared


@message("error")
class Error:
    code: int
    message: str
    tag: int = 0
    request_id: int = 0


# ------------------------------------------------------------------ control: executor -> sidecar


@message("attach")
class Attach:
    token: str
    pid: int
    engine: str = "torch"


@message("ready")
class Ready:
    slot: int
    epoch: int
    warm_ms: float = 0.0
    private_mib: float = 0.0     # device memory this executor holds beyond the shared regions


@message("weights_loading")
class WeightsLoading:
    slot: int
    epoch: int


@message("weights_sealed")
class WeightsSealed:
    slot: int
    epoch: int
    fingerprint: str
    load_ms: float = 0.0


@message("step")
class StepDone:
    """Tokens were committed to the journal for these journal slots."""
    slot: int
    epoch: int
    slots: list[int]


@message("recovered")
class Recovered:
    slot: int
    epoch: int
    report: dict


@message("bye")
class Bye:
    slot: int
    epoch: int
    reason: str = ""


# ------------------------------------------------------------------ control: sidecar -> executor


@message("attached")
class Attached:
    slot: int
    epoch: int
    generation: int
    nonce: str
    regions: list[dict]
    settings: dict
    weights: dict


@message("promote")
class Promote:
    """Become active. `pending_epochs`: fenced writers whose exit is not confirmed yet."""
    epoch: int
    pending_epochs: list[int]
    fenced_epoch: int = 0
    detect_ns: int = 0


@message("wake")
class Wake:
    pass


@message("reaped")
class Reaped:
    """These fenced epochs' processes have exited: their quarantined pages may be reused."""
    epochs: list[int]


@message("shutdown")
class Shutdown:
    reason: str = ""


# ------------------------------------------------------------------ client -> sidecar


@message("generate")
class Generate:
    tag: int
    params: dict
    prompt: str | None = None
    prompt_ids: list[int] | None = None


@message("cancel")
class Cancel:
    tag: int
    request_id: int


@message("status")
class Status:
    tag: int


@message("ping")
class Ping:
    tag: int


# ------------------------------------------------------------------ sidecar -> client


@message("accepted")
class Accepted:
    tag: int
    request_id: int
    prompt_tokens: int


@message("tokens")
class Tokens:
    request_id: int
    start: int
    ids: list[int]
    texts: list[str]


@message("done")
class Done:
    request_id: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    preemptions: int = 0          # times the request lost its KV to memory pressure
    recomputed_tokens: int = 0    # tokens whose KV was recomputed after executor crashes


@message("cancelled")
class Cancelled:
    tag: int
    request_id: int


@message("status_reply")
class StatusReply:
    tag: int
    status: dict


@message("pong")
class Pong:
    tag: int
    generation: int = 0


@message("keepalive")
class Keepalive:
    request_ids: list[int] = dataclasses.field(default_factory=list)


CONTROL_IN = frozenset({"attach", "ready", "weights_loading", "weights_sealed", "step",
                        "recovered", "bye"})
CLIENT_IN = frozenset({"generate", "cancel", "status", "ping"})
