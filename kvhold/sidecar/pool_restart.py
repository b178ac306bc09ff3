"""Pool restart, the old sidecar's half: drain, journal to disk, stop, re-exec in place.

`kvhold pool-restart` sends `PoolRestart` on the local client socket (TCP clients
may not). The sidecar replies at once, refuses new requests (`ShuttingDown`, a 503
over HTTP: retry), and on its next loop turn:
1. tells every client with a stream in flight that its streams pause (`Restarting`,
   with the grace to wait: the SDK stretches its silence timeout to it);
2. stops its executors (each finishes its current step: the shm journal is then still);
3. sends what was committed, ends the requests that finished, and writes every other
   request (prompt, sampling params, client key, committed tokens) to the durable
   journal (kvhold.sidecar.durable_journal), with the drain's timings in `last-drain.json`
   (read back by the new image, checked by `check_drain_record`);
4. leaves the loop, removes its memory, sockets and tables like any stop, and
   re-executes itself (`execv` of its own command line: same pid, same arguments, same
   terminal, same systemd unit or container; `kvhold serve` sees its child stay up). A
   spare that took over re-executes without `--spare`: it is the owner, and the lock it
   would wait in is gone with the clean stop.
   All memory is released by then: the process image that starts holds no device
   handle. With `hold`, that image first waits, touching no GPU, until the hold file in
   the runtime dir is removed (`kvhold pool-restart --resume`) or a SIGTERM ends it
   (the journal stays on disk for the next start). The hold file lives in the runtime
   dir, so a reboot clears it: the sidecar started at boot restores at once.
   (Steps 2-3 run in Sidecar.close(), which a SIGTERM runs too: a plain stop also
   journals its in-flight requests, and the next start brings them back.)
If the re-exec itself fails the process exits with EXIT_POOL_RESTART (76), which a
unit restarts (`RestartForceExitStatus=76`). The new image (kvhold.sidecar.readmit) reloads
the weights into a pool of the next generation and re-admits the journaled requests.
`PoolRestart` gets the frontend (admissions, streams), the durable journal, the
instance's paths (the hold file), the pool generation and a `send_client` callable.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.leases import now_ns
from kvhold.protocol.state_files import StateFileError, integer

log = logging.getLogger(__name__)
EXIT_POOL_RESTART = 76
POOL_RESTART_ENV = "KVHOLD_POOL_RESTART"    # set in a pool restart's new image (its start check)
HOLD_POLL_S = 0.2


def check_drain_record(doc: dict) -> None:
    """A drain's record (`last-drain.json`, the `report` below) as read back: a map of counts,
    times in ns and the `hold` flag; StateFileError naming the field that does not fit."""
    for key, value in doc.items():
        if key == "hold":
            if not isinstance(value, bool):
                raise StateFileError("hold is not true or false")
        else:
            integer(value, str(key)[:40], 0, (1 << 63) - 1)


class PoolRestart:
    def __init__(self, frontend, durable, paths, *, generation: int, send_client):
        self.frontend = frontend
        self.durable = durable
        self.paths = paths            # kvhold.protocol.naming.InstancePaths: the hold file
        self.generation = generation
        self.send_client = send_client
        self.request: m.PoolRestart | None = None
        self.draining = False     # clients told: the loop stops, close() stops the executors
        self.drained = False      # every in-flight request is on disk: re-exec
        self.report: dict = {}
        self.interrupted: dict | None = None    # the last drain whose sidecar died under it

    def owner_died(self, dead_pid: int, new_pid: int) -> bool:
        """The memory owner `dead_pid` died while this drain was asked or running, and `new_pid`
        (its spare) re-adopted the pool, of the same generation: the restart did not happen.
        The drain is dropped and admissions open again; the pool serves as it was, and the
        operator runs the restart again. True if a drain was dropped."""
        if self.request is None or self.drained:
            return False
        self.interrupted = {"generation": self.generation, "dead_pid": dead_pid, "readopted_by": new_pid,
                            "in_flight": self.report.get("in_flight", 0), "unix_ns": time.time_ns()}
        log.error("pool restart interrupted: the sidecar pid %d died during the drain and pid %d "
                  "re-adopted the pool (generation %d, unchanged); admissions open again. Run "
                  "`kvhold pool-restart` again to restart the pool", dead_pid, new_pid, self.generation)
        self.request, self.draining, self.report = None, False, {}
        self.frontend.open_admissions("pool_restart")
        return True

    @property
    def due(self) -> bool:
        """A drain was asked for and has not run yet (the daemon's loop runs it)."""
        return self.request is not None and not self.draining

    def on_request(self, identity: bytes, msg: m.PoolRestart):
        if identity[:1] != b"u":
            return m.Error(code=ErrorCode.UNAUTHORIZED, tag=msg.tag,
                           message="a pool restart is accepted only on the local ipc socket")
        if self.request is not None:
            return m.Error(code=ErrorCode.SHUTTING_DOWN, tag=msg.tag,
                           message="a pool restart is already in progress")
        if not msg.client_grace_s > 0:
            return m.Error(code=ErrorCode.INVALID_PARAMS, tag=msg.tag,
                           message="client_grace_s must be positive")
        fe = self.frontend
        self.request = msg
        fe.close_admissions("pool_restart", "a pool restart is in progress; retry in a few seconds")
        self.report = {"generation": self.generation, "hold": msg.hold,
                       "drain_start_ns": now_ns(), "drain_start_unix_ns": time.time_ns(),
                       "in_flight": len(fe.streams)}
        log.warning("pool restart requested: draining %d in-flight requests%s", len(fe.streams),
                    " (then holding for the operator)" if msg.hold else "")
        return m.PoolRestartReply(tag=msg.tag, generation=self.generation,
                                  in_flight=len(fe.streams), journal_dir=str(self.durable.dir))

    def start_drain(self) -> None:
        """On the loop, after the reply went out: tell the clients, then let the loop end."""
        self._notify_clients()
        self.report["clients_notified_ns"] = now_ns()
        self.draining = True

    def finish_drain(self) -> None:
        """From Sidecar.close(), once the executors are stopped: journal everything to disk."""
        self.report["executors_stopped_ns"] = now_ns()
        self.report["requests_journaled"] = journal_in_flight(self.frontend, self.durable)
        self.report["journaled_ns"] = now_ns()
        self.durable.write_json("last-drain.json", self.report)
        if self.request.hold:
            hold = {"pid": os.getpid(), "since_unix_ns": time.time_ns(),
                    "journal_dir": str(self.durable.dir), **self.report}
            self.paths.write_hold(hold)
        self.drained = True
        log.warning("pool restart: %d requests journaled to %s in %.1f ms; restarting the sidecar",
                    self.report["requests_journaled"], self.durable.dir,
                    (self.report["journaled_ns"] - self.report["drain_start_ns"]) / 1e6)

    def _notify_clients(self) -> None:
        fe, msg = self.frontend, self.request
        by_client: dict[bytes, list[int]] = {}
        for st in fe.streams.values():
            by_client.setdefault(st.identity, []).append(st.request_id)
        for identity, ids in by_client.items():
            self.send_client(identity, m.Restarting(
                request_ids=ids, resume_within_s=msg.client_grace_s,
                generation=self.generation))


def journal_in_flight(frontend, durable) -> int:
    """Stream what is committed, end what finished, write every other request to disk with
    its committed tokens. Executors must be stopped (the shm journal is still). Returns the
    number of requests written."""
    for st in list(frontend.streams.values()):
        frontend._pump(st)
    written = 0
    for st in frontend.streams.values():
        base = frontend.records.get(st.request_id)
        if base is None:
            continue
        _, count, _ = frontend.journal.progress(st.slot, st.request_id)
        cancelled = frontend.journal.is_cancelled(st.slot)
        durable.write(dict(base, generated=frontend.journal.generated(st.slot, 0, count),
                           cancelled=cancelled, state="drained"))
        written += 1
    return written


# ------------------------------------------------------------------ the process image


def wait_while_held(paths) -> bool:
    """Before a new pool is created: wait while the hold file exists. False if a SIGTERM/SIGINT
    asked to stop instead (the journal stays on disk for the next start)."""
    if not paths.on_hold:
        return True
    stop = []
    previous = {s: signal.signal(s, lambda *a: stop.append(a)) for s in (signal.SIGTERM, signal.SIGINT)}
    log.warning("pool restart on hold: the pool is released (no device memory is held). Do the "
                "upgrade, then run `kvhold pool-restart --resume --instance %s` (hold file %s)",
                paths.instance, paths.hold_file)
    try:
        while paths.on_hold and not stop:
            time.sleep(HOLD_POLL_S)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if stop:
        log.warning("stopped while on hold; the journaled requests come back at the next start")
        return False
    log.warning("hold released: starting the new pool")
    return True


def reexec(drop: tuple[str, ...] = ()) -> int:
    """Replace this process with a fresh image of itself (the same command line, less the flags
    in `drop`). Returns only on failure."""
    argv = [a for a in (getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]) if a not in drop]
    log.warning("pool restart: re-executing %s", " ".join(argv))
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.closerange(3, 1 << 16)    # nothing of the old pool may outlive it, CUDA handles included
    os.environ[POOL_RESTART_ENV] = "1"
    try:
        os.execv(sys.executable, argv)
    except OSError as exc:
        print(f"kvhold sidecar: re-exec failed ({exc}); exiting {EXIT_POOL_RESTART} so the "
              f"supervisor restarts the sidecar", file=sys.stderr)
    return EXIT_POOL_RESTART
