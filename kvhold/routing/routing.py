"""What the sync and asyncio routers (kvhold.routing.router, kvhold.routing.arouter) share, free of any I/O style.

`RouterCore` keeps the sidecar connections and the lost sidecars, picks where a request
goes and decides when a sidecar is lost (the rules are in kvhold.routing.router's module doc).
`StreamLog` is one routed request's bookkeeping: the tokens streamed so far (what a move
carries as Generate.prefix_generated), the moves and the final `RoutedResult`. Closing a
client and waiting are left to the two routers.
"""
from __future__ import annotations

import collections
import logging
import secrets
import time
from dataclasses import dataclass, replace

from kvhold.client.client import GenerationResult, TokenEvent
from kvhold.protocol.errors import Overloaded, ShuttingDown, SidecarUnavailable
from kvhold.routing.registry_client import RegistryView, SidecarEntry, node_name, pick_sidecar
from kvhold.protocol.sampling import RequestInput

log = logging.getLogger(__name__)
REFUSALS = (ShuttingDown, Overloaded, SidecarUnavailable)   # a sidecar that did not take a request


@dataclass(frozen=True, slots=True)
class RoutedResult(GenerationResult):
    moves: tuple = ()            # one dict per move: from, to, reason, tokens carried, times
    sidecars: tuple = ()         # registry keys that served the request, in order


@dataclass(slots=True)
class Conn:
    entry: SidecarEntry
    client: object               # a Client (sync) or an AsyncClient
    streams: int = 0
    lost: str = ""


def routed_request(request: RequestInput) -> RequestInput:
    """`request` with a seed: a move must continue the same random stream."""
    if request.sampling.seed is not None:
        return request
    return replace(request, sampling=replace(request.sampling, seed=secrets.randbits(63)))


class RouterCore:
    def __init__(self, view: RegistryView, *, poll_s: float = 0.05, silence_s: float = 5.0,
                 submit_timeout_s: float = 10.0, move_timeout_s: float = 30.0,
                 curve_secret_key_file=None, local_node: str | None = None):
        self.view = view
        self.poll_s = poll_s
        self.silence_s = silence_s
        self.submit_timeout_s = submit_timeout_s
        self.move_timeout_s = move_timeout_s
        self.curve_secret_key_file = curve_secret_key_file
        self.local_node = local_node or node_name()
        self._conns: dict[str, Conn] = {}
        self._lost: dict[str, int] = {}     # key -> pid of a lost sidecar, avoided while listed
        self.routed: collections.Counter = collections.Counter()   # placements per sidecar key

    def pick(self, exclude=(), fingerprint: str | None = None) -> SidecarEntry | None:
        entries = self.view.entries()
        listed = {e.key: e.pid for e in entries}
        for key, pid in list(self._lost.items()):
            if listed.get(key) != pid:   # gone from the registry, or a new process: forget
                del self._lost[key]
        pending = {k: c.streams for k, c in self._conns.items()}
        return pick_sidecar(entries, exclude=set(exclude) | set(self._lost), fingerprint=fingerprint,
                            local_node=self.local_node, pending=pending, used=self.routed)

    def address(self, entry: SidecarEntry) -> tuple[str, dict]:
        """(endpoint, CURVE client kwargs) to reach `entry` from this node."""
        local = entry.node == self.local_node
        curve = {} if local or not entry.curve_public_key else dict(
            curve_server_key=entry.curve_public_key.encode(),
            curve_secret_key_file=self.curve_secret_key_file)
        return (entry.endpoint if local else entry.tcp_endpoint), curve

    def cached(self, entry: SidecarEntry) -> tuple[Conn | None, Conn | None]:
        """(the live connection to `entry`, a stale one to close: same key, an older process)."""
        conn = self._conns.get(entry.key)
        if conn is not None and conn.entry.pid != entry.pid:
            del self._conns[entry.key]
            return None, conn
        return conn, None

    def add(self, entry: SidecarEntry, client) -> Conn:
        conn = self._conns[entry.key] = Conn(entry, client)
        return conn

    def loss_reason(self, conn: Conn, disconnected: bool) -> str:
        """Why `conn`'s sidecar is lost, or "" while it may be alive; a loss is recorded here and
        the caller closes the client."""
        entry = self.view.get(conn.entry.key)
        if disconnected:
            reason = "connection closed"
        elif self.view.connected and (entry is None or entry.pid != conn.entry.pid):
            reason = "registry entry gone (lease expired)"
        elif time.monotonic() - conn.client.last_heard > self.silence_s:
            reason = f"silent for {self.silence_s:.1f} s"
        else:
            return ""
        log.warning("sidecar %s (pid %d) lost: %s; moving its %d stream(s)", conn.entry.key,
                    conn.entry.pid, reason, conn.streams)
        conn.lost = reason
        self._lost[conn.entry.key] = conn.entry.pid
        if self._conns.get(conn.entry.key) is conn:
            del self._conns[conn.entry.key]
        return reason

    def move_deadline_passed(self, lost_at: float, reason: str) -> str:
        """The error text once a request has waited move_timeout_s for a sidecar, else ""."""
        if time.monotonic() - lost_at <= self.move_timeout_s:
            return ""
        return (f"no serving sidecar in the registry for {self.move_timeout_s:.0f} s"
                + (f" (after: {reason})" if reason else ""))


class StreamLog:
    """One routed request's tokens across sidecars, its moves, and its result."""

    def __init__(self, request: RequestInput):
        self.request = routed_request(request)
        self.token_ids: list[int] = []
        self.texts: list[str] = []
        self.moves: list[dict] = []
        self.sidecars: list[str] = []
        self.fingerprint: str | None = None
        self.prompt_tokens = 0
        self.conn: Conn | None = None
        self.segment_start = 0
        self.routed_result: RoutedResult | None = None
        self.prompt_logprobs = None       # the prompt's TokenLogprob list, with prompt_logprobs=k

    @property
    def all_sent(self) -> bool:
        """Every token was streamed: only the end was lost, there is nothing to move."""
        return len(self.token_ids) >= self.request.sampling.max_tokens

    def continuation(self) -> RequestInput:
        """The request to submit on the next sidecar: the prompt plus the tokens streamed so far."""
        return replace(self.request, prefix=list(self.token_ids))

    def stranded(self, inner) -> bool:
        """The sidecar's stream `inner` has nothing left to give: its sidecar was lost (found by
        another stream's wait) and it holds no token nor end not yet taken."""
        return bool(self.conn.lost) and not inner.buffered and not inner.finished

    def record(self, token_id: int, text: str, logprob=None, inner=None) -> TokenEvent:
        """`logprob`: the token's (with logprobs=k); `inner`: the sidecar's stream it came from,
        whose prompt log-probs (prompt_logprobs=k) the first stream to have them brings."""
        if self.moves and "first_token_s" not in self.moves[-1]:
            self.moves[-1]["first_token_s"] = time.monotonic() - self.moves[-1]["lost_at"]
        if self.prompt_logprobs is None and inner is not None:
            self.prompt_logprobs = inner.prompt_logprobs
        event = TokenEvent(index=len(self.token_ids), token_id=token_id, text=text, logprob=logprob)
        self.token_ids.append(token_id)
        self.texts.append(text)
        return event

    def leave(self) -> bool:
        """Before a (re)placement: let go of the sidecar the stream was on; True when the
        stream is over instead (every token was streamed: finished, 'length')."""
        if self.conn is None:
            return False
        self.conn.streams -= 1
        if self.all_sent:
            self.finish(None, "length")
            return True
        return False

    def refused(self, router: RouterCore, conn: Conn, exc: Exception, skip: set[str]) -> None:
        """`conn`'s sidecar did not take the request (one of REFUSALS): the placement is taken
        back and the others are tried."""
        self.reserve(router, conn, taken=False)
        log.info("sidecar %s did not take the request: %s", conn.entry.key, exc)
        skip.add(conn.entry.key)

    @staticmethod
    def round_over(router: RouterCore, lost_at: float, reason: str, skip: set[str]) -> None:
        """No sidecar took the request this round: SidecarUnavailable once it has waited
        move_timeout_s, else every sidecar may be tried again."""
        error = router.move_deadline_passed(lost_at, reason)
        if error:
            raise SidecarUnavailable(error)
        skip.clear()

    @staticmethod
    def reserve(router: RouterCore, conn: Conn, taken: bool = True) -> None:
        """Count a placement on `conn` before submitting (so that concurrent picks see it), or
        take it back (`taken` False) when the sidecar refused."""
        step = 1 if taken else -1
        conn.streams += step
        router.routed[conn.entry.key] += step

    def placed(self, old: Conn | None, conn: Conn, reason: str, lost_at: float, prompt_tokens: int) -> None:
        """After reserve() and a successful submit."""
        self.conn, self.segment_start = conn, len(self.token_ids)
        self.fingerprint = self.fingerprint or conn.entry.fingerprint
        self.prompt_tokens = self.prompt_tokens or prompt_tokens
        if old is not None:
            self.moves.append({"from": old.entry.key, "to": conn.entry.key, "reason": reason,
                               "tokens_carried": len(self.token_ids), "lost_at": lost_at,
                               "resubmitted_s": time.monotonic() - lost_at})
        self.sidecars.append(conn.entry.key)

    def finish(self, last: GenerationResult | None, reason: str = "") -> None:
        if self.conn is not None and last is not None:
            self.conn.streams -= 1
        text = "".join(self.texts[:self.segment_start]) + (last.text if last else "".join(
            self.texts[self.segment_start:]))
        self.routed_result = RoutedResult(
            request_id=last.request_id if last else 0, token_ids=list(self.token_ids), text=text,
            finish_reason=last.finish_reason if last else reason, prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.token_ids), preemptions=last.preemptions if last else 0,
            recomputed_tokens=last.recomputed_tokens if last else 0,
            cached_tokens=last.cached_tokens if last else 0, moves=tuple(self.moves), sidecars=tuple(self.sidecars))
