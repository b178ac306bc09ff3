"""The dashboards against a real Prometheus scraping a real `kvhold serve`: every query of
kvhold's own dashboard (deploy/grafana/kvhold.json), and every query of vLLM's example Grafana
dashboard through the scrape job that renames kvhold's series to vLLM's names
(deploy/prometheus/scrape/vllm-names.yaml), returns data once requests have run; the per-request
panels return numbers, not only NaN.

Prometheus is Debian's `prometheus` package (.ci/run installs it); KVHOLD_REQUIRE_PROMTOOL=1
makes its absence a failure instead of a skip."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from kvhold.testing.etcd_process import free_port
from tests.process.helpers import Server, completion, wait_until

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
MODEL = "tiny-v1"

# The queries of vLLM's example dashboard (examples/online_serving/prometheus_grafana/grafana.json
# in vLLM's repository), by panel; each must return data through the renaming scrape job.
VLLM_PANELS = {
    "E2E Request Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
        'rate(vllm:e2e_request_latency_seconds_sum{model_name="$model_name"}[$__rate_interval])'
        ' / rate(vllm:e2e_request_latency_seconds_count{model_name="$model_name"}[$__rate_interval])'],
    "Token Throughput": ['rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
                         'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])'],
    "Time Per Output Token Latency": [
        'histogram_quantile(0.5, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
        'rate(vllm:time_per_output_token_seconds_sum{model_name="$model_name"}[$__rate_interval])'
        ' / rate(vllm:time_per_output_token_seconds_count{model_name="$model_name"}[$__rate_interval])'],
    "Scheduler State": ['vllm:num_requests_running{model_name="$model_name"}',
                        'vllm:num_requests_waiting{model_name="$model_name"}'],
    "Time To First Token Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="$model_name"}[$__rate_interval])))',
        'rate(vllm:time_to_first_token_seconds_sum{model_name="$model_name"}[$__rate_interval])'
        ' / rate(vllm:time_to_first_token_seconds_count{model_name="$model_name"}[$__rate_interval])'],
    "Cache Utilization": ['vllm:gpu_cache_usage_perc{model_name="$model_name"}'],
    "Request Prompt Length": [
        'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'],
    "Request Generation Length": [
        'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))'],
    "Finish Reason": ['sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))'],
    "Queue Time": ['rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'],
    "Requests Prefill and Decode Time": [
        'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
        'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])'],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])'],
}
# per-request series: their panels must show numbers once requests have run (the others,
# recoveries with none having happened, may be NaN)
PER_REQUEST = ("prompt_tokens", "generation_tokens", "time_to_first_token", "time_per_output_token",
               "e2e_request_latency", "prefix_cache")


def _kvhold_queries() -> dict[str, list[str]]:
    dash = json.loads((ROOT / "deploy" / "grafana" / "kvhold.json").read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dash["panels"]}


def _resolved(expr: str) -> str:
    return expr.replace("$model_name", MODEL).replace("$__rate_interval", "1m")


@pytest.fixture
def prometheus(tmp_path):
    if PROMETHEUS is None:
        if os.environ.get("KVHOLD_REQUIRE_PROMTOOL") == "1":
            pytest.fail("prometheus is not installed (Debian's prometheus package)")
        pytest.skip("needs Debian's prometheus")
    procs = []

    def start(target: str) -> str:
        renaming = yaml.safe_load((ROOT / "deploy" / "prometheus" / "scrape" / "vllm-names.yaml").read_text())
        as_vllm = renaming["scrape_configs"][0]
        as_vllm["static_configs"] = [{"targets": [target]}]
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "scrape_configs": [{"job_name": "kvhold", "static_configs": [{"targets": [target]}]}, as_vllm]}
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"], stdout=log, stderr=log))
        base = f"http://127.0.0.1:{port}"

        def ready():
            try:
                return httpx.get(base + "/-/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(ready, 60, 0.1, what="Prometheus to be ready")
        return base

    yield start
    for p in procs:
        p.terminate()
        p.wait(30)


def _query(base: str, expr: str) -> list[float]:
    r = httpx.get(base + "/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return [float(s["value"][1]) for s in r.json()["data"]["result"]]


def test_every_dashboard_query_returns_data(tiny_model, tmp_path, runtime_root, prometheus):
    srv = Server(tiny_model, runtime_root, tmp_path / "serve.log")
    try:
        base = prometheus(f"127.0.0.1:{srv.port}")
        queries = {**{f"kvhold: {t}": q for t, q in _kvhold_queries().items()},
                   **{f"vLLM: {t}": q for t, q in VLLM_PANELS.items()}}
        shared = [300 + j for j in range(40)]              # the prefix cache finds its first pages again

        def answered():
            # a request between every look: the counters rise between two scrapes however slow
            # this machine is, and the 1-minute windows hold them
            completion(srv, prompt=shared + [len(seen)], max_tokens=6, temperature=0.0)
            seen.append(1)
            missing = []
            for title, exprs in queries.items():
                for expr in exprs:
                    values = _query(base, _resolved(expr))
                    finite = [v for v in values if math.isfinite(v)]
                    if not values or (any(k in expr for k in PER_REQUEST) and not finite):
                        missing.append((title, expr))
            return not missing or None
        seen: list[int] = []
        wait_until(answered, 120, 0.5, what="every dashboard query to return data")
    finally:
        srv.stop()
    assert seen                                            # requests ran before the queries answered


def test_the_kvhold_dashboard_is_grafana_json_over_kvholds_series():
    dash = json.loads((ROOT / "deploy" / "grafana" / "kvhold.json").read_text())
    assert {v["name"] for v in dash["templating"]["list"]} == {"DS_PROMETHEUS", "model_name"}
    exprs = [e for qs in _kvhold_queries().values() for e in qs]
    assert exprs and all("kvhold_" in e for e in exprs)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    # every series a panel reads is one kvhold's exporter writes (a status with everything in it)
    from prometheus_client.parser import text_string_to_metric_families

    from kvhold.serving.metrics import SidecarMetrics

    m = SidecarMetrics(MODEL)
    m.observe({"executors": [{"slot": 0, "role": "active", "pid": 1, "heartbeat_age_ms": 1.0}],
               "pages": {"total": 10, "free": 9, "committed": 1}, "requests": {"in_flight": 0, "waiting": 0},
               "weights": {"state": "sealed"}, "generation": 1, "recoveries": [], "events": [], "spares": [],
               "prefix_cache": {"queries": 0, "hits": 0}, "serving": {"page_tokens": 16}})
    exported = {s.name for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    for expr in exprs:
        for name in re.findall(r"kvhold_[a-z0-9_]+", expr):
            assert name in exported, name
