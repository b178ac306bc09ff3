"""Every message kvhold processes exchange, as typed wire structs (see kvhold.protocol.wire).

Two sockets, two vocabularies:
* control (executor <-> sidecar): attach/attached, ready, weights_*, step, recovered,
  bye, failing; and from the sidecar: promote, wake, reaped, shutdown.
* client (SDK <-> sidecar): generate/accepted, tokens, done, cancel/cancelled,
  status/status_reply, ping/pong, keepalive; for pool restarts pool_restart/
  pool_restart_reply, restarting and resume; for an operator's view of admissions
  admissions/admissions_reply.
Both use `error` (code from kvhold.protocol.errors.ErrorCode). Client requests carry a `tag`
chosen by the client and echoed in the reply, so replies can be matched.
"""
from __future__ import annotations

import dataclasses

from kvhold.protocol.recovery_report import RecoveryReport
from kvhold.protocol.sampling import SamplingParams
from kvhold.protocol.settings import ExecutorSettings
from kvhold.protocol.wire import message

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
    phases: dict = dataclasses.field(default_factory=dict)   # warm-up parts, ms
    ranks: list[int] = dataclasses.field(default_factory=list)   # pids of a group's ranks 1..N-1 (its children)


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
    """Tokens were committed to the journal for these journal slots. `step_tokens`: the tokens
    each step since the last StepDone computed (prefill and decode), vLLM's iteration tokens."""
    slot: int
    epoch: int
    slots: list[int]
    marks: dict = dataclasses.field(default_factory=dict)   # first step after a takeover: its parts (ns)
    step_tokens: list[int] = dataclasses.field(default_factory=list)


@message("recovered")
class Recovered:
    """The takeover is done (kvhold.protocol.recovery_report)."""
    slot: int
    epoch: int
    report: RecoveryReport


@message("bye")
class Bye:
    slot: int
    epoch: int
    reason: str = ""


@message("failing")
class Failing:
    """The executor's device context is lost (a CUDA fault): fence it now, it exits at once.

    Sent on the way out, before the process is torn down, so the standby takes over
    without waiting for the kernel to release a faulted context."""
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
    settings: ExecutorSettings
    weights: dict


@message("promote")
class Promote:
    """Become active. `pending_epochs`: fenced writers whose exit is not confirmed yet.
    `isolate`: [request id, KV end] of requests that were in a dead executor's step (see
    kvhold.sidecar.request_deaths): each runs the step reaching that KV end again alone."""
    epoch: int
    pending_epochs: list[int]
    fenced_epoch: int = 0
    detect_ns: int = 0
    isolate: list[list[int]] | None = None


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
    """`prefix_generated`: tokens an earlier run of this request already produced (it is being
    moved from a sidecar that died). Generation continues after them with the same seed and
    absolute positions; the stream, `Accepted` and `Done` count only the new tokens.
    `params`: the request's sampling fields (kvhold.protocol.sampling), a map on the wire."""
    tag: int
    params: SamplingParams
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    prefix_generated: list[int] | None = None


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
    """Generated tokens from index `start`. A request that asked for log-probs gets each token's
    (`logprobs`) and its `logprobs` most likely tokens (`top_ids`, `top_logprobs`, most likely
    first) under the model's raw distribution; one that asked for prompt_logprobs gets, on the
    message with start 0, its prompt's ids and the same for each prompt token after the first."""
    request_id: int
    start: int
    ids: list[int]
    texts: list[str]
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None
    ranks: list[int] | None = None          # each token's rank (1: the most likely), with logprobs
    prompt_ranks: list[int] | None = None   # the same for the prompt's tokens after the first


@message("done")
class Done:
    request_id: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    text: str = ""
    preemptions: int = 0          # times the request lost its KV to memory pressure
    recomputed_tokens: int = 0    # tokens whose KV was recomputed after executor crashes
    cached_tokens: int = 0        # prompt tokens whose KV came from the prefix cache
    queue_s: float | None = None    # admitted -> first in an executor's step (None: not known)
    prefill_s: float | None = None  # first in a step -> first token committed


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



# ------------------------------------------------------------------ pool restart (kvhold.sidecar.pool_restart)


@message("pool_restart")
class PoolRestart:
    """Operator (local socket only): drain, journal every in-flight request to disk, stop the
    executors and restart the sidecar in place with a new pool generation. `hold`: the new
    sidecar waits for `kvhold pool-restart --resume` before it creates any memory."""
    tag: int
    hold: bool = False
    client_grace_s: float = 300.0   # the pause SDK clients are told to wait through


@message("pool_restart_reply")
class PoolRestartReply:
    tag: int
    generation: int                 # the generation being drained
    in_flight: int
    journal_dir: str


@message("restarting")
class Restarting:
    """Sidecar -> client: the pool restarts; these streams pause for up to `resume_within_s`."""
    request_ids: list[int]
    resume_within_s: float
    generation: int


@message("resume")
class Resume:
    """Client -> sidecar, after a silence: continue each stream from the index the client has
    reached (`next_indices[i]` for `request_ids[i]`); the sidecar re-sends from there."""
    request_ids: list[int]
    next_indices: list[int]


# ------------------------------------------------------------------ admissions (kvhold.sidecar.health_responder)


@message("admissions")
class Admissions:
    """Operator (local socket only): report whether new requests are admitted and who closed
    them; `reopen`: first lift the closure of a health action (the operator checked the GPU)."""
    tag: int
    reopen: bool = False


@message("admissions_reply")
class AdmissionsReply:
    tag: int
    open: bool
    closed_by: dict                 # who keeps admissions closed -> why (empty when open)


# ------------------------------------------------------------------ prefix cache (kvhold.executor.prefix_cache)


@message("reset_prefix_cache")
class ResetPrefixCache:
    """Client -> sidecar (vLLM's POST /reset_prefix_cache): free every idle cached page; the
    reply comes once the active executor has."""
    tag: int


@message("reset_prefix_cache_reply")
class ResetPrefixCacheReply:
    tag: int


CONTROL_IN = frozenset({"attach", "ready", "weights_loading", "weights_sealed", "step",
                        "recovered", "bye"})
CLIENT_IN = frozenset({"generate", "cancel", "status", "ping", "pool_restart", "resume",
                       "admissions", "reset_prefix_cache"})
