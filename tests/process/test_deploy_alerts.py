"""Every shipped alert (deploy/prometheus/kvhold-alerts.yaml) fires on its first event, checked
by `promtool test rules` over series scraped from kvhold's real exporter.

Each scenario drives `SidecarMetrics` (what `kvhold serve` answers on GET /metrics) minute by
minute with sidecar statuses made by the sidecar's own recovery timeline, scrapes its text
exposition once a minute as Prometheus would (adding the target's `job`/`instance` labels and
`up`), and hands the scraped series to promtool with the shipped rules. Labelled counters must
be scraped at zero before their first event: `increase()` over a series that appears at 1
sees no increase, and the alert would miss the first hang, the first damaged request.
promtool is Debian's `prometheus` package (.ci/run installs it); KVHOLD_REQUIRE_PROMTOOL=1
makes its absence a failure instead of a skip.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvhold.protocol.leases import now_ns
from kvhold.protocol.recovery_report import FENCE_REASONS, RECORD_CLASSES, RECOVERY_PHASES, RecoveryReport
from kvhold.serving.metrics import SidecarMetrics
from kvhold.sidecar.timeline import RecoveryTimeline

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "kvhold-alerts.yaml"
TARGET = {"job": "kvhold", "instance": "gpu-0"}
PROMTOOL = shutil.which("promtool")


def _shipped_alerts() -> set[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return {r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r}


def _steady(executors=("active", "standby"), pages=None, health=None, timeline=None, spares=(4242,)) -> dict:
    """A sidecar status as `Sidecar.status()` shapes it (the fields the exporter reads)."""
    tl = timeline or RecoveryTimeline()
    return {"weights": {"state": "sealed"}, "generation": 1, "spares": list(spares),
            "pages": pages or {"total": 100, "free": 80, "used": 20, "quarantined": 0, "bad": 0},
            "executors": [{"slot": i, "pid": 100 + i, "role": r, "ready": True, "heartbeat_age_ms": 3.0}
                          for i, r in enumerate(executors)],
            "requests": {"in_flight": 2, "admitted_total": 10, "finished": {"stop": 8}},
            "events": tl.events(), "recoveries": tl.records(),
            **({"health": health} if health is not None else {})}


def _failover(tl: RecoveryTimeline, epoch: int, reason: str, first_token_s: float, **counts) -> None:
    """One failover as the sidecar records it: the supervisor's fence event, the promoted
    executor's RecoveryReport, then its first step (first resumed token `first_token_s` after
    the detection)."""
    t = now_ns()
    detect = t - int(first_token_s * 1e9)
    tl.event({"kind": "fence", "ns": detect + 1000, "slot": 0, "pid": 1000 + epoch, "epoch": epoch,
              "reason": reason, "detail": "", "role": "ACTIVE", "detect_ns": detect,
              "fenced_ns": detect + 1000, "fenced_epoch": epoch})
    report = RecoveryReport(detect_ns=detect, promoted_ns=detect + 2000, validated_ns=detect + 3000,
                            resumed_ns=detect + 4000, fenced_epoch=epoch, pages_checked=4,
                            requests_resumable=1, **counts)
    tl.recovered(2000 + epoch, epoch + 1, report)
    tl.step_done(epoch + 1, {}, t)


def _scrape(metrics: SidecarMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = {**s.labels, **TARGET}
            out[s.name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"] = s.value
    return out


def _series(scrapes: list[dict[str, float] | None]) -> list[dict]:
    """promtool input series, one value a minute; `_` where a series was not scraped."""
    names = sorted({k for s in scrapes if s for k in s})
    series = [{"series": n, "values": " ".join(_fmt(s.get(n)) if s else "_" for s in scrapes)} for n in names]
    up = "up{" + ",".join(f'{k}="{v}"' for k, v in sorted(TARGET.items())) + "}"
    series.append({"series": up, "values": " ".join("0" if s is None else "1" for s in scrapes)})
    return series


def _fmt(v) -> str:
    return "_" if v is None else repr(float(v))


def _firing(alert: str, at: str, labels: list[dict] | None) -> dict:
    """A promtool check that `alert` fires at `at` with these extra labels each (None: silent)."""
    samples = []
    for extra in labels or []:
        lab = {"alertname": alert, "alertstate": "firing", **TARGET, **extra}
        samples.append({"labels": "ALERTS{" + ",".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}",
                        "value": 1})
    return {"expr": f'ALERTS{{alertname="{alert}",alertstate="firing"}}', "eval_time": at,
            "exp_samples": samples}


def _run(minutes: int, at_minute) -> list[dict[str, float] | None]:
    """Scrapes of a fresh exporter, minute 0 first; `at_minute(t, metrics)` returns the status
    to observe at minute t (None: the target is not scraped that minute)."""
    metrics, scrapes = SidecarMetrics(), []
    for t in range(minutes):
        status = at_minute(t, metrics)
        if status is None:
            scrapes.append(None)
            continue
        if status != "unavailable":
            metrics.observe(status)
        scrapes.append(_scrape(metrics))
    return scrapes


# ---------------------------------------------------------------------------------- scenarios
def _first_failover():
    """A quiet start, then at minute 3 one failover: the executor hung, the first resumed token
    came 6 s later, one request damaged and one lost, one page bad."""
    tl = RecoveryTimeline()

    def at(t, m):
        if t == 3:
            _failover(tl, 7, "hang", 6.0, requests_damaged=1, requests_lost=1, pages_bad=1)
        return _steady(timeline=tl)

    sev = lambda s: {"severity": s}
    checks = [_firing("KvholdExecutorHung", "5m", [{"reason": "hang", **sev("warning")}]),
              _firing("KvholdExecutorHung", "2m", None),
              _firing("KvholdRecoverySlow", "5m", [sev("warning")]),
              _firing("KvholdRecoveryVerySlow", "5m", [sev("critical")]),
              _firing("KvholdKvPagesBad", "5m", [sev("warning")]),
              _firing("KvholdRequestsDamagedOrLost", "5m", [{"class": "damaged", **sev("warning")},
                                                            {"class": "lost", **sev("warning")}]),
              _firing("KvholdExecutorRestartStorm", "5m", None)]
    return _run(8, at), checks


def _restart_storm():
    """Executors die once a minute from minute 3: the sixth death within 10 min raises the storm."""
    tl = RecoveryTimeline()

    def at(t, m):
        if 3 <= t <= 8:
            _failover(tl, 10 + t, "died", 0.05)
        return _steady(timeline=tl)

    return _run(11, at), [_firing("KvholdExecutorRestartStorm", "7m", None),
                          _firing("KvholdExecutorRestartStorm", "8m", [{"severity": "critical"}])]


def _pages():
    """From minute 2: pages flagged bad, pages quarantined, the pool 96% used."""
    def at(t, m):
        if t < 2:
            return _steady()
        return _steady(pages={"total": 100, "free": 4, "used": 93, "quarantined": 1, "bad": 2})

    sev = lambda s: [{"state": s[0], "severity": s[1]}]
    return _run(20, at), [_firing("KvholdKvPagesBadNow", "8m", sev(("bad", "warning"))),
                          _firing("KvholdKvPagesQuarantinedStuck", "13m", sev(("quarantined", "warning"))),
                          _firing("KvholdKvPoolNearlyFull", "18m", [{"severity": "info"}])]


def _no_executors():
    """From minute 2 no executor at all: nothing active, no standby."""
    return _run(14, lambda t, m: _steady(executors=() if t >= 2 else ("active", "standby"))), [
        _firing("KvholdNoExecutorServing", "4m", [{"role": "active", "severity": "critical"}]),
        _firing("KvholdNoHotStandby", "13m", [{"role": "standby", "severity": "warning"}])]


def _no_spare():
    """The spare sidecar took over at minute 2 and no new one came: none waits from then on."""
    return _run(9, lambda t, m: _steady(spares=() if t >= 2 else (4242,))), [
        _firing("KvholdNoSpareSidecar", "6m", None), _firing("KvholdNoSpareSidecar", "7m", [{"severity": "warning"}])]


def _never_a_spare():
    """A plain `kvhold sidecar` with no spare ever: the alert stays silent."""
    return _run(9, lambda t, m: _steady(spares=())), [_firing("KvholdNoSpareSidecar", "8m", None)]


def _health(action: str, alert: str, severity: str):
    def at(t, m):
        return _steady(health={"action": action if t >= 2 else "none", "events": []})

    return lambda: (_run(5, at), [_firing(alert, "3m", [{"action": action, "severity": severity}])])


def _unreachable():
    """`kvhold serve` runs but its sidecar stops answering at minute 2."""
    def at(t, m):
        if t >= 2:
            m.unavailable("sidecar not answering")
            return "unavailable"
        return _steady()

    return _run(6, at), [_firing("KvholdSidecarUnreachable", "4m", [{"severity": "critical"}])]


def _target_down():
    """Prometheus stops reaching /metrics at minute 2 (`up` 0, no kvhold series)."""
    return _run(6, lambda t, m: _steady() if t < 2 else None), [
        _firing("KvholdTargetDown", "5m", [{"severity": "critical"}])]


def _http_errors():
    """From minute 1, of 100 API requests a minute 10 get a 500 and 5 a 429."""
    def at(t, m):
        if t >= 1:
            m.http.labels("/v1/completions", "200").inc(85)
            m.http.labels("/v1/completions", "500").inc(10)
            m.http.labels("/v1/completions", "429").inc(5)
        return _steady()

    return _run(20, at), [_firing("KvholdHttpServerErrors", "18m", [{"severity": "warning"}]),
                          _firing("KvholdRequestSlotsExhausted", "18m", [{"code": "429", "severity": "info"}])]


SCENARIOS = {"first_failover": _first_failover, "restart_storm": _restart_storm, "pages": _pages,
             "no_executors": _no_executors, "no_spare": _no_spare,
             "never_a_spare": _never_a_spare,
             "nvml_restart_executor": _health("restart_executor", "KvholdNvmlRestartExecutor", "warning"),
             "nvml_drain": _health("drain", "KvholdNvmlEscalation", "critical"),
             "unreachable": _unreachable, "target_down": _target_down, "http_errors": _http_errors}


# ---------------------------------------------------------------------------------- tests
def test_the_first_scrape_has_every_labelled_counter_at_zero():
    scrape = _scrape(SidecarMetrics())
    tail = lambda **labels: "{" + ",".join(f'{k}="{v}"' for k, v in sorted({**labels, **TARGET}.items())) + "}"
    for reason in FENCE_REASONS:
        assert scrape.get("kvhold_executor_restarts_total" + tail(reason=reason)) == 0.0, reason
    for klass in RECORD_CLASSES:
        assert scrape.get("kvhold_recovered_requests_total" + tail(**{"class": klass})) == 0.0, klass
    for phase in RECOVERY_PHASES:
        assert scrape.get("kvhold_recovery_phase_seconds_count" + tail(phase=phase)) == 0.0, phase
        assert scrape.get("kvhold_recovery_phase_seconds_bucket" + tail(phase=phase, le="+Inf")) == 0.0


def test_every_shipped_alert_has_a_scenario():
    checked = {c["expr"].split('"')[1] for make in SCENARIOS.values() for c in make()[1] if c["exp_samples"]}
    assert checked == _shipped_alerts()


@pytest.mark.skipif(PROMTOOL is None and os.environ.get("KVHOLD_REQUIRE_PROMTOOL") != "1",
                    reason="promtool not installed (Debian: apt-get install prometheus)")
def test_each_alert_fires_on_its_first_event(tmp_path):
    assert PROMTOOL, "KVHOLD_REQUIRE_PROMTOOL=1 but promtool is not on PATH"
    tests = []
    for name, make in SCENARIOS.items():
        scrapes, checks = make()
        tests.append({"name": name, "interval": "1m", "input_series": _series(scrapes),
                      "promql_expr_test": checks})
    spec = tmp_path / "kvhold-alerts.test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
                                    "tests": tests}, sort_keys=False))
    run = subprocess.run([PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
