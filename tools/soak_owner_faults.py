"""The soak's faults of the processes around the executors (tools.bench_soak).

`kvhold serve` runs the memory owner (`kvhold sidecar --external-frontend`), a spare of it,
the frontend and the HTTP server; these plans hit the first three, and restart the pool:

* `sidecar_sigkill`: SIGKILL the memory owner while its spare waits; the spare re-adopts the
  pool and its executors. Observed: a status from a new owner that names the killed pid as
  the one it followed (`spare.previous_pid`).
* `frontend_sigkill`: SIGKILL the frontend process; serve starts another, which adopts the
  streams. Observed: a status from a frontend of another pid whose owner answered.
* `spare_sigkill`: SIGKILL the waiting spare; serve starts another. Observed: the killed pid
  gone from the owner's list of waiting spares, and another waiting.
* `pool_restart`: `kvhold pool-restart --continue` (drain, journal to disk, re-execute, restore).
  Observed: the command's exit code 0 and a status of the next pool generation.

A plan runs only from a state where it can (the frontend's owner answers; for the two that
take the spare, a spare waits, its marker written; the owner or the frontend to be killed has
served a minute since it took over, as serve treats closer deaths as a crash loop); otherwise the soak takes an executor fault
this cycle and tries the plan again the next (counted as deferred). Each fault is counted once observed, never from the plan.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter

from kvhold.serving.serve import HEALTHY_RUN_S

OWNER_PLANS = ("sidecar_sigkill", "frontend_sigkill", "spare_sigkill", "pool_restart")
# how long the owner or the frontend serves before a plan kills it: past kvhold serve's crash-loop window
OWNER_UPTIME_S = HEALTHY_RUN_S + 1


class OwnerFaults:
    def __init__(self, obs, instance: str, runtime_root, timeout_s: float, owner_uptime_s: float = OWNER_UPTIME_S):
        self.obs, self.instance, self.runtime_root, self.timeout_s = obs, instance, str(runtime_root), timeout_s
        self.owner_uptime_s = owner_uptime_s
        # when the process each of these plans kills started serving (the soak's start, then the
        # kill it took over from): kvhold serve restarts either after a death at once only when
        # it had served HEALTHY_RUN_S, with a backoff (the frontend) or not at all (the owner,
        # after three deaths within a minute) otherwise: its guards against a crash loop
        self.serving_since = {"sidecar_sigkill": time.monotonic(), "frontend_sigkill": time.monotonic()}
        self.records: list[dict] = []           # one per fault planned: what was observed
        self.notes: Counter = Counter()

    def ready(self, st: dict, plan: str) -> bool:
        """Whether `plan` can hit its process now: the frontend is connected to a serving owner,
        for the plans that take the spare (a SIGKILL of the owner or of the spare) one waits, and
        the owner and the frontend are killed only once they have served `owner_uptime_s` (default
        OWNER_UPTIME_S: `kvhold serve` stops after SIDECAR_RESTARTS deaths of its owner that
        close together, and restarts a frontend that dies sooner after a growing backoff: its
        guards against a crash loop)."""
        fe = st.get("frontend") or {}
        serving = bool(st.get("pid")) and bool(fe.get("pid")) and fe.get("owner_answered", False)
        since = self.serving_since.get(plan)
        if since is not None and time.monotonic() - since < self.owner_uptime_s:
            return False
        return serving and (bool(st.get("spares")) or plan not in ("sidecar_sigkill", "spare_sigkill"))

    def observed(self) -> Counter:
        return Counter(r["plan"] for r in self.records if r["observed"])

    def run(self, cycle: int, plan: str) -> dict:
        st = self.obs.last
        t0 = time.monotonic_ns()
        rec = {"cycle": cycle, "plan": plan, "observed": False}
        if plan == "pool_restart":
            generation = st["generation"]
            cmd = [sys.executable, "-m", "kvhold", "pool-restart", "--instance", self.instance,
                   "--runtime-root", self.runtime_root, "--continue", "--timeout", str(self.timeout_s)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s + 60)
            rec["exit_code"] = done.returncode
            if done.returncode != 0:
                rec["output"] = (done.stdout + done.stderr)[-400:]
            after = self.obs.wait(lambda s: s if s.get("generation", 0) > generation else None, self.timeout_s)
            rec["observed"] = done.returncode == 0 and after is not None
            if after is not None:
                rec["restore"] = {k: v for k, v in ((after.get("pool_restart") or {}).get("restore") or {}).items()
                                  if isinstance(v, (int, float, str))}
        else:
            victim = {"sidecar_sigkill": st["pid"], "frontend_sigkill": (st.get("frontend") or {}).get("pid"),
                      "spare_sigkill": (st.get("spares") or [None])[0]}[plan]
            rec["victim"] = victim
            try:
                os.kill(victim, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                self.notes[f"{plan}: victim already gone"] += 1
                return rec
            if plan == "sidecar_sigkill":
                seen = lambda s: s if s.get("pid") not in (None, victim) and \
                    (s.get("spare") or {}).get("previous_pid") == victim else None  # noqa: E731
            elif plan == "frontend_sigkill":
                seen = lambda s: s if (s.get("frontend") or {}).get("pid") not in (None, victim) and \
                    (s.get("frontend") or {}).get("owner_answered") else None  # noqa: E731
            else:
                seen = lambda s: s if victim not in s.get("spares", [victim]) and s.get("spares") else None  # noqa: E731
            after = self.obs.wait(seen, self.timeout_s)
            rec["observed"] = after is not None
            if plan == "sidecar_sigkill" and after is not None:
                rec["took_over_by"], rec["spare"] = after["pid"], after.get("spare")
        rec["observed_after_ms"] = (time.monotonic_ns() - t0) / 1e6
        if plan in self.serving_since:
            self.serving_since[plan] = time.monotonic()
        if not rec["observed"]:
            self.notes[f"{plan}: not observed within {self.timeout_s:.0f} s"] += 1
        self.records.append(rec)
        return rec

    def summary(self) -> dict:
        out = {}
        for plan in OWNER_PLANS:
            sel = [r for r in self.records if r["plan"] == plan]
            times = sorted(r["observed_after_ms"] for r in sel if r["observed"])
            out[plan] = {"planned": len(sel), "observed": len(times),
                         "observed_after_ms": {"p50": times[len(times) // 2], "max": times[-1]} if times else None}
        return out
