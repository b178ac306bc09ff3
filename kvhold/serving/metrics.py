"""Prometheus metrics for `kvhold serve`, built from the sidecar's status.

Two kinds of series:
* live gauges, read from the latest status at scrape time (a custom collector):
  heartbeat age per executor, executors by role, KV pages by state, requests in
  flight and finished, weights sealed, NVML health (`status["health"]`, optional);
* events observed once each as they appear in the status (recovery records and
  fence events, keyed by their own timestamps): the recovery-time histogram and its
  phases, requests by recovery class, pages checked/bad, tokens recomputed and kept,
  executor restarts by reason.
Recovery times count from the sidecar's detection of the failure (a SIGKILL is
detected ~0.2 ms after the death; `python -m tools.bench_detect` measures that part).
"""
from __future__ import annotations

import time

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvhold.protocol.recovery_report import FENCE_REASONS, RECORD_CLASSES, RECOVERY_PHASES

RECOVERY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# recovery record field -> phase name (each measured from detect_ns); "fence" is the fence event's
PHASES = {mark: phase for phase, mark in RECOVERY_PHASES.items() if phase != "fence"}
CLASSES = RECORD_CLASSES
HEALTH_ACTIONS = ("none", "restart_executor", "restart_pool", "drain")
FIRST_TOKEN_WAIT_S = 30.0
disable_created_metrics()  # the *_created series only add noise to a sidecar's dashboard


class SidecarMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.recovery = Histogram("kvhold_recovery_seconds", "Executor failover: detection to the "
                                  "first resumed token", buckets=RECOVERY_BUCKETS, registry=r)
        self.phase = Histogram("kvhold_recovery_phase_seconds", "Failover phases, each from detection: "
                               "fence, takeover, validate, resume, first_token", ["phase"],
                               buckets=RECOVERY_BUCKETS, registry=r)
        self.classes = Counter("kvhold_recovered_requests", "Requests in flight at a failover, by "
                               "recovery class", ["class"], registry=r)
        self.recomputed = Counter("kvhold_tokens_recomputed", "Tokens whose KV was recomputed "
                                  "after a failover", registry=r)
        self.kept = Counter("kvhold_kv_tokens_kept", "Tokens whose KV survived a failover", registry=r)
        self.pages_checked = Counter("kvhold_recovery_pages_checked", "KV pages validated", registry=r)
        self.pages_bad = Counter("kvhold_recovery_pages_bad", "KV pages failing validation", registry=r)
        self.restarts = Counter("kvhold_executor_restarts", "Executors fenced and replaced, by reason",
                                ["reason"], registry=r)
        self.http = Counter("kvhold_http_requests", "HTTP API requests", ["endpoint", "code"], registry=r)
        self.ttft = Histogram("kvhold_http_time_to_first_token_seconds", "Request received to first "
                              "token", ["endpoint"], buckets=RECOVERY_BUCKETS, registry=r)
        # Every known label value exists from the first scrape, at zero: Prometheus's increase()
        # and rate() need a sample before the first event to count it.
        for phase in RECOVERY_PHASES:
            self.phase.labels(phase)
        for c in CLASSES:
            self.classes.labels(c)
        for reason in FENCE_REASONS:
            self.restarts.labels(reason)
        r.register(_LiveCollector(self))
        self.status: dict | None = None
        self.status_error: str | None = "not polled yet"
        self._seen: set = set()
        self._first_seen: dict = {}

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def unavailable(self, reason: str) -> None:
        self.status, self.status_error = None, reason

    def observe(self, status: dict) -> None:
        """Take a fresh status: keep it for the gauges, count new records once."""
        self.status, self.status_error = status, None
        keys = set()
        for ev in status.get("events", []):
            if ev.get("kind") == "fence":
                key = ("fence", ev.get("ns"), ev.get("pid"))
                keys.add(key)
                if key not in self._seen:
                    self._seen.add(key)
                    self._on_fence(ev)
        for rec in status.get("recoveries", []):
            key = ("recovery", rec.get("fenced_epoch"), rec.get("detect_ns"))
            keys.add(key)
            if key not in self._seen and self._complete(key, rec):
                self._seen.add(key)
                self._on_recovery(rec)
        self._seen &= keys  # records gone from the status cannot come back
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in keys}

    def _complete(self, key, rec: dict) -> bool:
        """A record is counted once its first resumed token is known (or nothing awaits one)."""
        waiting = sum(rec.get(f"requests_{c}", 0) for c in ("resumable", "damaged", "lost"))
        if "first_token_ns" in rec or not waiting:
            return True
        first = self._first_seen.setdefault(key, time.monotonic())
        return time.monotonic() - first > FIRST_TOKEN_WAIT_S

    def _on_fence(self, ev: dict) -> None:
        self.restarts.labels(str(ev.get("reason", "unknown"))).inc()   # one of FENCE_REASONS
        if ev.get("fenced_ns") and ev.get("detect_ns"):
            self.phase.labels("fence").observe(max(0, ev["fenced_ns"] - ev["detect_ns"]) / 1e9)

    def _on_recovery(self, rec: dict) -> None:
        t0 = rec.get("detect_ns")
        if t0:
            for field, phase in PHASES.items():
                if rec.get(field):
                    self.phase.labels(phase).observe(max(0, rec[field] - t0) / 1e9)
            if rec.get("first_token_ns"):
                self.recovery.observe(max(0, rec["first_token_ns"] - t0) / 1e9)
        for c in CLASSES:
            self.classes.labels(c).inc(rec.get(f"requests_{c}", 0))
        self.recomputed.inc(rec.get("tokens_recomputed", 0))
        self.kept.inc(rec.get("tokens_kept", 0))
        self.pages_checked.inc(rec.get("pages_checked", 0))
        self.pages_bad.inc(rec.get("pages_bad", 0))


class _LiveCollector:
    def __init__(self, owner: SidecarMetrics):
        self.owner = owner

    def collect(self):
        st = self.owner.status
        yield GaugeMetricFamily("kvhold_sidecar_up", "1 when the sidecar answered the last status "
                                "request", value=0 if st is None else 1)
        if st is None:
            return
        yield from _executor_metrics(st.get("executors", []))
        pages = GaugeMetricFamily("kvhold_kv_pages", "KV pool pages by state", labels=["state"])
        for state, n in st.get("pages", {}).items():
            pages.add_metric([state], n)
        yield pages
        req = st.get("requests", {})
        yield GaugeMetricFamily("kvhold_requests_in_flight", "Requests admitted and not finished",
                                value=req.get("in_flight", 0))
        yield CounterMetricFamily("kvhold_requests_admitted", "Requests admitted by the sidecar",
                                  value=req.get("admitted_total", 0))
        fin = CounterMetricFamily("kvhold_requests_finished", "Finished requests by reason",
                                  labels=["reason"])
        for reason, n in req.get("finished", {}).items():
            fin.add_metric([reason], n)
        yield fin
        yield GaugeMetricFamily("kvhold_weights_sealed", "1 when the weights are loaded and sealed",
                                value=int(st.get("weights", {}).get("state") == "sealed"))
        yield GaugeMetricFamily("kvhold_pool_generation", "Pool generation (bumped by pool restarts)",
                                value=st.get("generation", 0))
        yield from _health_metrics(st.get("health"))


def _executor_metrics(executors: list[dict]):
    age = GaugeMetricFamily("kvhold_executor_heartbeat_age_seconds", "Time since each executor's "
                            "last heartbeat", labels=["slot", "role", "pid"])
    roles = GaugeMetricFamily("kvhold_executors", "Executors by role", labels=["role"])
    counts: dict[str, int] = {}
    for e in executors:
        age.add_metric([str(e["slot"]), e["role"], str(e["pid"])], e["heartbeat_age_ms"] / 1e3)
        counts[e["role"]] = counts.get(e["role"], 0) + 1
    for role in sorted(set(counts) | {"active", "standby"}):
        roles.add_metric([role], counts.get(role, 0))
    yield age
    yield roles


def _health_metrics(health: dict | None):
    yield GaugeMetricFamily("kvhold_nvml_health_reported", "1 when the sidecar reports NVML health",
                            value=int(isinstance(health, dict)))
    if not isinstance(health, dict):
        return
    action = health.get("action", "none")
    g = GaugeMetricFamily("kvhold_nvml_health_action", "Escalation the NVML health monitor asks "
                          "for (1 = current)", labels=["action"])
    for a in sorted(set(HEALTH_ACTIONS) | {action}):
        g.add_metric([a], int(a == action))
    yield g
    yield GaugeMetricFamily("kvhold_nvml_health_events", "NVML health events in the last report",
                            value=len(health.get("events") or []))
