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
* per-request series as vLLM exports them (labelled `model_name`), observed by the HTTP
  server as each request ends (`observe_request`): prompt and generation token counters,
  time to first token, time per output token (each gap between two tokens), end-to-end
  latency, decode time (first token to last), prompt and generation lengths, preemptions,
  and the sidecar's queue time (admission to the request's first step) and prefill time (first
  step to first token committed), from its Done message;
  and, from the status, running and waiting requests and the KV cache usage ratio.
  docs/METRICS.md maps vLLM's names to these.
"""
from __future__ import annotations

import time

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvhold.protocol.recovery_report import FENCE_REASONS, RECORD_CLASSES, RECOVERY_PHASES

RECOVERY_BUCKETS = (0.001, 0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.06, 0.075,
                    0.1, 0.15, 0.2, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
# Every bucket edge of vLLM's histogram of the same name is an edge of kvhold's (a dashboard's
# histogram_quantile reads alike), with finer ones where kvhold's latencies live.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                     10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                          10.0, 20.0, 40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LATENCY_BUCKETS = VLLM_TTFT_BUCKETS
TOKEN_GAP_BUCKETS = tuple(sorted(set(VLLM_TOKEN_GAP_BUCKETS) | {0.001, 0.005, 0.015, 0.02, 0.03, 0.04}))
REQUEST_LATENCY_BUCKETS = tuple(sorted(set(VLLM_REQUEST_LATENCY_BUCKETS) | set(VLLM_TTFT_BUCKETS)))
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)   # 1-2-5
N_BUCKETS = (1, 2, 5, 10, 20)
# recovery record field -> phase name (each measured from detect_ns); "fence" is the fence event's
PHASES = {mark: phase for phase, mark in RECOVERY_PHASES.items() if phase != "fence"}
CLASSES = RECORD_CLASSES
HEALTH_ACTIONS = ("none", "restart_executor", "restart_pool", "drain")
FIRST_TOKEN_WAIT_S = 30.0
disable_created_metrics()  # the *_created series only add noise to a sidecar's dashboard


class RequestMetrics:
    """The per-request series (module docstring), in `registry`, labelled `model_name`."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        from kvhold import __version__

        self.model_name = model_name
        r, m = registry, ["model_name"]
        self.prompt_tokens = Counter("kvhold_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("kvhold_generation_tokens", "Tokens generated for finished "
                                         "requests", m, registry=r)
        self.request_ttft = Histogram("kvhold_time_to_first_token_seconds", "Request received to its "
                                      "first token", m, buckets=LATENCY_BUCKETS, registry=r)
        self.token_gap = Histogram("kvhold_time_per_output_token_seconds", "Time between two tokens of "
                                   "one request (inter-token latency)", m, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("kvhold_e2e_request_latency_seconds", "Request received to its last "
                             "token", m, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.decode = Histogram("kvhold_request_decode_time_seconds", "A request's first token to its "
                                "last", m, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("kvhold_request_queue_time_seconds", "A request's admission by the "
                               "sidecar to its first step in an executor", m, buckets=REQUEST_LATENCY_BUCKETS,
                               registry=r)
        self.prefill = Histogram("kvhold_request_prefill_time_seconds", "A request's first step to its "
                                 "first token committed", m, buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.inference = Histogram("kvhold_request_inference_time_seconds", "A request's first step to "
                                   "its last token (prefill and decode)", m, buckets=REQUEST_LATENCY_BUCKETS,
                                   registry=r)
        self.params_max_tokens = Histogram("kvhold_request_params_max_tokens", "max_tokens of finished "
                                           "requests", m, buckets=LENGTH_BUCKETS, registry=r)
        self.params_n = Histogram("kvhold_request_params_n", "n (choices) of HTTP requests", m,
                                  buckets=N_BUCKETS, registry=r)
        self.max_generation = Histogram("kvhold_request_max_num_generation_tokens", "The most tokens one "
                                        "choice of an HTTP request generated", m, buckets=LENGTH_BUCKETS,
                                        registry=r)
        self.prompt_len = Histogram("kvhold_request_prompt_tokens", "Prompt length of finished "
                                    "requests", m, buckets=LENGTH_BUCKETS, registry=r)
        self.generation_len = Histogram("kvhold_request_generation_tokens", "Tokens generated per "
                                        "finished request", m, buckets=LENGTH_BUCKETS, registry=r)
        self.preemptions = Counter("kvhold_num_preemptions", "Times a finished request was preempted "
                                   "(its KV evicted and recomputed) for want of KV pages", m, registry=r)
        self.finished = Counter("kvhold_request_success", "Finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)
        Gauge("kvhold_build_info", "kvhold's version", ["version"], registry=r).labels(__version__).set(1)
        # every series exists from start-up, at zero (a dashboard's panels have data before the
        # first request ends, and rate() counts that request)
        for c in (self.prompt_tokens, self.generation_tokens, self.preemptions, self.request_ttft,
                  self.token_gap, self.e2e, self.decode, self.queue, self.prefill, self.inference,
                  self.prompt_len, self.generation_len, self.params_max_tokens, self.params_n,
                  self.max_generation):
            c.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(model_name, reason)

    def observe(self, *, received: float, first_token: float | None, token_times: list[float],
                end: float, prompt_tokens: int, generation_tokens: int, preemptions: int,
                finish_reason: str | None, queue_s: float | None = None,
                prefill_s: float | None = None, max_tokens: int | None = None) -> None:
        """One request as it ended (times: time.monotonic()); a request that produced nothing
        counts its length and reason only. `queue_s`/`prefill_s`: the sidecar's durations (None:
        not known, not observed)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(generation_tokens)
        self.prompt_len.labels(name).observe(prompt_tokens)
        self.generation_len.labels(name).observe(generation_tokens)
        self.preemptions.labels(name).inc(preemptions)
        self.finished.labels(name, finish_reason if finish_reason in ("stop", "length") else "abort").inc()
        self.e2e.labels(name).observe(max(0.0, end - received))
        if first_token is not None:
            self.request_ttft.labels(name).observe(max(0.0, first_token - received))
            self.decode.labels(name).observe(max(0.0, end - first_token))
        if queue_s is not None:
            self.queue.labels(name).observe(max(0.0, queue_s))
        if prefill_s is not None:
            self.prefill.labels(name).observe(max(0.0, prefill_s))
            if first_token is not None:
                self.inference.labels(name).observe(max(0.0, prefill_s) + max(0.0, end - first_token))
        if max_tokens is not None:
            self.params_max_tokens.labels(name).observe(max_tokens)
        gap = self.token_gap.labels(name)
        for a, b in zip(token_times, token_times[1:]):
            gap.observe(max(0.0, b - a))



class SidecarMetrics:
    def __init__(self, model_name: str = ""):
        self.model_name = model_name
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
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            self.ttft.labels(endpoint)
        self.requests = RequestMetrics(r, model_name)
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

    def observe_request(self, **request) -> None:
        self.requests.observe(**request)

    def observe_choices(self, n: int) -> None:
        """An HTTP request's `n`."""
        self.requests.params_n.labels(self.model_name).observe(n)

    def observe_choices_ended(self, generated: list[int]) -> None:
        """An HTTP request's choices all ended, each having generated so many tokens."""
        self.requests.max_generation.labels(self.model_name).observe(max(generated, default=0))

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
        pages = GaugeMetricFamily("kvhold_kv_pages", "KV pool pages by state (they add up to "
                                  "kvhold_kv_pool_pages)", labels=["state"])
        counts = st.get("pages", {})
        for state, n in counts.items():
            if state != "total":
                pages.add_metric([state], n)
        yield pages
        total = counts.get("total", 0)
        yield GaugeMetricFamily("kvhold_kv_pool_pages", "KV pool pages in all (page 0, the null page, "
                                "included)", value=total)
        yield _usage(self.owner.model_name, total, counts.get("free", 0) + counts.get("cached", 0))
        yield from _prefix_cache_metrics(self.owner.model_name, st.get("prefix_cache"))
        yield from _iteration_tokens(self.owner.model_name, st.get("iteration_tokens"))
        serving = st.get("serving") or {}
        if serving.get("page_tokens"):
            info = GaugeMetricFamily("kvhold_cache_config_info", "The KV cache's configuration, as "
                                     "vLLM's cache_config_info: 1, its settings as labels",
                                     labels=["block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"])
            info.add_metric([str(serving["page_tokens"]), str(max(0, total - 1)), str(serving.get("kv_dtype", "")),
                             str(bool(serving.get("prefix_caching")))], 1)
            yield info
        req = st.get("requests", {})
        yield GaugeMetricFamily("kvhold_requests_in_flight", "Requests admitted and not finished",
                                value=req.get("in_flight", 0))
        waiting = req.get("waiting", 0)
        running = GaugeMetricFamily("kvhold_num_requests_running", "Requests with a token generated, "
                                    "not finished", labels=["model_name"])
        running.add_metric([self.owner.model_name], max(0, req.get("in_flight", 0) - waiting))
        yield running
        queued = GaugeMetricFamily("kvhold_num_requests_waiting", "Requests admitted with no token "
                                   "generated yet (queued or in prefill)", labels=["model_name"])
        queued.add_metric([self.owner.model_name], waiting)
        yield queued
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
        yield GaugeMetricFamily("kvhold_sidecar_spares", "Spare sidecars waiting to take over if the "
                                "sidecar dies (kvhold sidecar --spare)", value=len(st.get("spares") or []))
        yield from _health_metrics(st.get("health"))


def _prefix_cache_metrics(model_name: str, cache: dict | None):
    """vLLM's prefix_cache_queries and prefix_cache_hits, over the requests the frontend saw
    finish (a frontend restart starts them again: a counter reset); absent without a cache."""
    if not cache:
        return
    for name, what in (("queries", "Prompt tokens of finished requests, looked up in the prefix cache"),
                       ("hits", "Prompt tokens of finished requests whose KV the prefix cache served")):
        c = CounterMetricFamily(f"kvhold_prefix_cache_{name}", what, labels=["model_name"])
        c.add_metric([model_name], cache.get(name, 0))
        yield c


def _iteration_tokens(model_name: str, hist: dict | None):
    """vLLM's iteration_tokens_total: the tokens (prefill and decode) of each engine step, as the
    memory owner counted them since its start (kvhold.sidecar.iteration_tokens)."""
    if not hist or len(hist.get("counts", ())) != len(hist.get("buckets", ())) + 1:
        return
    h = HistogramMetricFamily("kvhold_iteration_tokens", "Tokens computed by each engine step "
                              "(prefill and decode), since the sidecar started", labels=["model_name"])
    cumulative, buckets = 0, []
    for le, n in zip(hist["buckets"], hist["counts"]):
        cumulative += n
        buckets.append((str(float(le)), cumulative))
    buckets.append(("+Inf", cumulative + hist["counts"][-1]))
    h.add_metric([model_name], buckets, sum_value=hist.get("sum", 0))
    yield h


def _usage(model_name: str, total: int, free: int) -> GaugeMetricFamily:
    """`free` includes idle prefix-cache pages, which the pool evicts when it needs room (as
    vLLM counts its cached blocks)."""
    g = GaugeMetricFamily("kvhold_kv_cache_usage_ratio", "KV pool pages in use, 0 to 1 (the null page "
                          "left out; idle prefix-cache pages count as free)", labels=["model_name"])
    g.add_metric([model_name], (total - free) / max(1, total - 1) if total else 0.0)
    return g


def _executor_metrics(executors: list[dict]):
    # by lease slot and role, not pid: a new pid at every restart would start a new series
    age = GaugeMetricFamily("kvhold_executor_heartbeat_age_seconds", "Time since each executor's "
                            "last heartbeat", labels=["slot", "role"])
    roles = GaugeMetricFamily("kvhold_executors", "Executors by role", labels=["role"])
    counts: dict[str, int] = {}
    for e in executors:
        age.add_metric([str(e["slot"]), e["role"]], e["heartbeat_age_ms"] / 1e3)
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
