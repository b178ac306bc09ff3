"""deploy/ must match the code: commands, flags, env vars, metric names, HTTP routes.

Every YAML file parses; every systemd unit parses; every kvhold command line in a unit
(ExecStart=, ExecStartPre=, ...) or in a Kubernetes container names a real subcommand
and only flags its argparse parser accepts; every KVHOLD_* variable set is read by the
code; every metric and label in the Prometheus rules is one kvhold/metrics.py exports;
every probe and scrape path is a route of the FastAPI app; stop timeouts cover the drain.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvhold.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
YAML_FILES = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
UNIT_FILES = sorted(p for ext in ("service", "socket", "target", "timer", "path")
                    for p in (DEPLOY / "systemd").glob(f"*.{ext}"))
ENV_EXAMPLES = sorted((DEPLOY / "systemd").glob("*.env*"))
RULE_FILES = sorted((DEPLOY / "prometheus").glob("*.y*ml"))
K8S_FILES = sorted((DEPLOY / "kubernetes").glob("*.y*ml"))
POD_KINDS = {"Pod", "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}
# kvhold serve, after the drain: uvicorn's graceful shutdown (5 s) + SidecarChild.stop (20 s).
SERVE_STOP_AFTER_DRAIN_S = 5 + 20
DEFAULT_DRAIN_S = 30.0


def test_deploy_files_exist():
    assert UNIT_FILES and K8S_FILES and RULE_FILES, "deploy/ lost its systemd, Kubernetes or Prometheus files"
    assert (DEPLOY / "README.md").is_file()


# ---------------------------------------------------------------------------- YAML


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path} holds no YAML document"


def _docs(paths) -> list[tuple[Path, dict]]:
    return [(p, d) for p in paths for d in yaml.safe_load_all(p.read_text()) if d is not None]


# ---------------------------------------------------------------------------- command lines


def _check_kvhold_argv(argv: list[str], where: str) -> tuple[str, dict]:
    """`argv` starts at the kvhold executable; parse it as the CLI would. -> (command, parsed)."""
    assert Path(argv[0]).name == "kvhold", f"{where}: runs {argv[0]!r}, not kvhold"
    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args, unknown = parser.parse_known_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse: {err.getvalue().strip()}")
    assert not unknown, f"{where}: flags kvhold {argv[1] if len(argv) > 1 else ''} does not have: {unknown}"
    # argparse also takes unambiguous prefixes (--kv-mem): deploy files spell flags out.
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    spelled = {o for a in sub._actions for o in a.option_strings}
    short = [w for w in argv[2:] if w.startswith("--") and w.split("=")[0] not in spelled]
    assert not short, f"{where}: abbreviated or unknown flags {short}"
    return args.command, vars(args)


# ---------------------------------------------------------------------------- systemd


def _parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}: repeated keys kept, continuations joined."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line[0] in "#;":
            continue
        while line.endswith("\\") and i < len(lines):
            line = line[:-1] + " " + lines[i].strip()
            i += 1
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}: bad section header {line!r}"
            current = line[1:-1]
            assert current not in sections, f"{path.name}: section [{current}] twice"
            sections[current] = []
            continue
        assert current is not None, f"{path.name}: {line!r} before any [section]"
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}: not key=value: {line!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def _unit_values(unit, section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key), f"{path.name}: not KEY=VALUE: {line!r}"
        env[key] = shlex.split(value)[0] if value.strip() else ""
    return env


@lru_cache(maxsize=None)
def _example_env() -> dict[str, str]:
    env = {}
    for path in ENV_EXAMPLES:
        env.update(_env_file(path))
    return env


def _unit_env(unit) -> dict[str, str]:
    env = dict(_example_env())
    for value in _unit_values(unit, "Service", "Environment"):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            env[key] = val
    return env


def _systemd_argv(command: str, env: dict[str, str]) -> list[str]:
    """Expand specifiers and variables as systemd would, with dummies for the unknown."""
    command = command.lstrip("-@:+!")
    command = re.sub(r"%%", "\0", command)
    command = re.sub(r"%[a-zA-Z]", "x0", command).replace("\0", "%")
    words = []
    for word in shlex.split(command):
        bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if bare:  # $VAR: word-split, and nothing when unset
            words += shlex.split(env.get(bare.group(1), ""))
            continue
        words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env.get(m.group(1), "dummy"), word))
    return words


EXEC_KEYS = ("ExecStartPre", "ExecStart", "ExecStartPost", "ExecReload", "ExecStop", "ExecStopPost",
             "ExecCondition")


@pytest.mark.parametrize("path", UNIT_FILES, ids=lambda p: p.name)
def test_systemd_unit_runs_real_commands_and_flags(path):
    unit = _parse_unit(path)
    assert "Unit" in unit and "Description" in dict(unit["Unit"]), f"{path.name}: no [Unit] Description="
    if path.suffix != ".service":
        return
    env = _unit_env(unit)
    starts = _unit_values(unit, "Service", "ExecStart")
    assert len(starts) == 1, f"{path.name}: wants exactly one ExecStart="
    for key in EXEC_KEYS:
        for command in _unit_values(unit, "Service", key):
            argv = _systemd_argv(command, env)
            if Path(argv[0]).name == "kvhold" or key == "ExecStart":
                _check_kvhold_argv(argv, f"{path.name} {key}=")


@pytest.mark.parametrize("path", [p for p in UNIT_FILES if p.suffix == ".service"], ids=lambda p: p.name)
def test_systemd_unit_runtime_dir_and_stop(path):
    unit = _parse_unit(path)
    svc = dict(unit["Service"])
    env = _unit_env(unit)
    assert env.get("KVHOLD_RUNTIME_DIR") == "%t/kvhold", f"{path.name}: set KVHOLD_RUNTIME_DIR=%t/kvhold"
    assert svc.get("User") and svc.get("User") != "root", f"{path.name}: run as a service user"
    command, args = _check_kvhold_argv(_systemd_argv(svc["ExecStart"], env), path.name)
    if command in ("sidecar", "serve"):
        # The owner of the runtime root: kvhold wants it owned by the user, 0700, and all
        # instances share it, so one unit's stop must not remove it.
        assert svc.get("RuntimeDirectory") == "kvhold"
        assert svc.get("RuntimeDirectoryMode") == "0700"
        assert svc.get("RuntimeDirectoryPreserve") == "yes"
        # SIGTERM to the main process only: it stops its children in order (drain first).
        if command == "serve":     # serve restarts a dead sidecar itself; systemd acts once serve is gone
            assert svc.get("KillMode") == "mixed", f"{path.name}: KillMode=mixed, or the executors get SIGTERM at once"
        else:
            # nothing above the sidecar but systemd: a dead sidecar's executors must be left alive,
            # waiting with their memory, for the restarted sidecar to re-adopt them
            assert svc.get("KillMode") == "process", \
                f"{path.name}: KillMode=process, or systemd kills the executors (and the memory) with a dead sidecar"
            assert svc.get("Restart") in ("on-failure", "always"), f"{path.name}: restart a sidecar that dies"
            wait_s = (args.get("sidecar_wait_ms") or 30_000) / 1000
            restart_s = float(svc.get("RestartSec", "0.1").rstrip("s"))
            assert restart_s + 10 < wait_s, \
                f"{path.name}: RestartSec={restart_s:g} + a start must stay under --sidecar-wait-ms ({wait_s:g} s)"
        stop_s = float(svc.get("TimeoutStopSec", "90").rstrip("s"))
        need = SERVE_STOP_AFTER_DRAIN_S + (args.get("drain_timeout") or DEFAULT_DRAIN_S) if command == "serve" else 15
        assert stop_s > need, f"{path.name}: TimeoutStopSec={stop_s:g} must exceed {need:g} s"
    if command == "executor":
        assert "BindsTo" in dict(unit["Unit"]), f"{path.name}: an external executor is bound to its sidecar"


# ---------------------------------------------------------------------------- environment


@lru_cache(maxsize=None)
def _env_vars_read_by_code() -> frozenset[str]:
    names = set()
    for pkg in ("kvhold", "tools"):
        for py in (ROOT / pkg).rglob("*.py"):
            text = py.read_text(errors="replace")
            names |= set(re.findall(r"KVHOLD_[A-Z0-9_]+", text))
            names |= {f"KVHOLD_{n}" for n in re.findall(r"(?<![\w.])_?env\(\s*[\"']([A-Z0-9_]+)[\"']", text)}
    return frozenset(names)


def _k8s_envs():
    for path, container in _containers():
        for item in container.get("env", []):
            yield f"{path.name}:{container['name']}", item["name"]


def test_every_kvhold_env_var_is_read_by_the_code():
    used = [(p.name, k) for p in ENV_EXAMPLES for k in _env_file(p)]
    for path in UNIT_FILES:
        for value in _unit_values(_parse_unit(path), "Service", "Environment"):
            used += [(path.name, item.partition("=")[0]) for item in shlex.split(value)]
    used += list(_k8s_envs())
    unknown = [(where, k) for where, k in used if k.startswith("KVHOLD_") and k not in _env_vars_read_by_code()]
    assert not unknown, f"KVHOLD_ variables that no code reads: {unknown}"


# ---------------------------------------------------------------------------- Kubernetes


def _pod_spec(doc: dict) -> dict | None:
    if doc.get("kind") not in POD_KINDS:
        return None
    spec = doc["spec"]
    if doc["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec if doc["kind"] == "Pod" else spec["template"]["spec"]


def _containers():
    for path, doc in _docs(K8S_FILES):
        spec = _pod_spec(doc)
        for container in (spec or {}).get("initContainers", []) + (spec or {}).get("containers", []):
            yield path, container


def _k8s_argv(container: dict) -> list[str]:
    words = list(container.get("command", [])) + list(container.get("args", []))
    assert all(isinstance(w, str) for w in words), f"{container['name']}: command/args must be strings: {words}"
    env = {e["name"]: e.get("value", "dummy") for e in container.get("env", [])}
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), "dummy"), w) for w in words]


@lru_cache(maxsize=None)
def _app_routes() -> frozenset[str]:
    from kvhold.serving.http_api import AppSettings, create_app

    app = create_app(AppSettings(endpoint="ipc:///nonexistent/client.sock", model_dir=None,
                                 served_model_name="m", context_len=16))
    return frozenset(getattr(r, "path", None) for r in app.routes)


def test_kubernetes_containers_run_real_commands_and_flags():
    checked = 0
    for path, container in _containers():
        argv = _k8s_argv(container)
        kvhold_at = [i for i, w in enumerate(argv) if Path(w).name == "kvhold"]
        if kvhold_at:
            _check_kvhold_argv(argv[kvhold_at[0]:], f"{path.name} container {container['name']}")
            checked += 1
    assert checked, "no Kubernetes container runs kvhold"


def test_kubernetes_pods_probe_real_routes_and_drain_in_time():
    pods = [(p, doc, _pod_spec(doc)) for p, doc in _docs(K8S_FILES) if _pod_spec(doc)]
    assert pods
    for path, doc, spec in pods:
        for container in spec["containers"]:
            argv = _k8s_argv(container)
            if "kvhold" not in [Path(w).name for w in argv]:
                continue
            command, args = _check_kvhold_argv(argv[[Path(w).name for w in argv].index("kvhold"):], path.name)
            assert command == "serve", f"{path.name}: the pod runs `kvhold serve` (HTTP, /health, /metrics)"
            ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
            assert args["port"] in ports.values() and args["host"] == "0.0.0.0", \
                f"{path.name}: --port/--host must match the containerPort and be reachable"
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = container.get(kind)
                assert probe, f"{path.name}: {container['name']} has no {kind}"
                get = probe["httpGet"]
                assert get["path"] in _app_routes(), f"{path.name} {kind}: {get['path']} is not a route"
                assert get["port"] in ports or get["port"] in ports.values()
            assert "nvidia.com/gpu" in container["resources"]["limits"]
            # A liveness failure restarts the container and loses the GPU memory: it must
            # tolerate far more than a cold executor start; the startup probe covers loading.
            live, start = container["livenessProbe"], container["startupProbe"]
            assert live["periodSeconds"] * live["failureThreshold"] >= 60
            assert start["periodSeconds"] * start["failureThreshold"] >= args["start_timeout"]
            pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
            pre_s = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
            need = pre_s + args["drain_timeout"] + SERVE_STOP_AFTER_DRAIN_S
            assert spec.get("terminationGracePeriodSeconds", 30) > need, \
                f"{path.name}: terminationGracePeriodSeconds must exceed {need:g} s"
            mounts = {m["mountPath"] for m in container.get("volumeMounts", [])}
            assert "/dev/shm" in mounts, f"{path.name}: mount a memory-backed emptyDir at /dev/shm"
        annotations = doc["spec"].get("template", {}).get("metadata", {}).get("annotations", {})
        if "prometheus.io/path" in annotations:
            assert annotations["prometheus.io/path"] in _app_routes()


def test_servicemonitors_scrape_real_routes():
    for path, doc in _docs(K8S_FILES):
        if doc.get("kind") == "ServiceMonitor":
            for endpoint in doc["spec"]["endpoints"]:
                assert endpoint.get("path", "/metrics") in _app_routes(), path.name


# ---------------------------------------------------------------------------- Prometheus


def _page_states() -> set[str]:
    from kvhold.protocol.layout import PageFlag
    from kvhold.protocol.page_table import PageTable

    class Empty(PageTable):
        def __init__(self):
            self.num_pages = 1

        def snapshot(self, retries: int = 100):
            return np.zeros(1, dtype=[("version", "u8"), ("owner", "u8"), ("flags", "u4")])

    assert PageFlag.BAD and PageFlag.QUARANTINED
    return set(Empty().counts())


@lru_cache(maxsize=None)
def _exported() -> dict[str, dict[str, set[str]]]:
    """{sample name: {label: values seen}} from kvhold's own registry, every series made to appear."""
    from kvhold.serving.metrics import HEALTH_ACTIONS, SidecarMetrics

    m = SidecarMetrics()
    rec = {"fenced_epoch": 1, "detect_ns": 1, "promoted_ns": 2, "validated_ns": 3, "resumed_ns": 4,
           "first_token_ns": 5, "requests_resumable": 1, "tokens_recomputed": 1, "tokens_kept": 1,
           "pages_checked": 1, "pages_bad": 1}
    status = {"weights": {"state": "sealed"}, "generation": 1,
              "pages": {s: 1 for s in _page_states()},
              "executors": [{"slot": 0, "pid": 5, "role": "active", "ready": True, "heartbeat_age_ms": 1.0}],
              "requests": {"in_flight": 1, "admitted_total": 1, "finished": {"stop": 1}},
              "events": [{"kind": "fence", "ns": 1, "pid": 4, "reason": "died", "detect_ns": 1, "fenced_ns": 2}],
              "recoveries": [rec], "health": {"action": HEALTH_ACTIONS[0], "events": []}}
    m.observe(status)
    m.http.labels("/v1/completions", "200").inc()
    m.ttft.labels("/v1/completions").observe(0.1)
    out: dict[str, dict[str, set[str]]] = {}
    for family in m.registry.collect():
        for sample in family.samples:
            labels = out.setdefault(sample.name, {})
            for k, v in sample.labels.items():
                labels.setdefault(k, set()).add(v)
    return out


@lru_cache(maxsize=None)
def _known_label_values() -> dict[str, set[str]]:
    """Label values that come from code, not from the synthetic status above."""
    from kvhold.protocol.layout import Role
    from kvhold.protocol.recovery_report import FENCE_REASONS
    from kvhold.serving.metrics import CLASSES, HEALTH_ACTIONS, PHASES

    return {"action": set(HEALTH_ACTIONS), "class": set(CLASSES), "phase": set(PHASES.values()) | {"fence"},
            "role": {r.name.lower() for r in Role}, "state": _page_states(),
            "reason": set(FENCE_REASONS)}


# Prometheus's own per-target series, not kvhold's: allowed by name.
PROMETHEUS_SERIES = {"up"}
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "container", "endpoint"}
_TOKEN = re.compile(r"""
    (?P<str>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|[smhdwy])?(?:\d+(?:ms|[smhdwy]))*)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[{}()\[\],:=<>+\-*/%^@])
  | (?P<ws>\s+)
""", re.X)
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan"}
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
# Aggregations may put `by (...)` between their name and their "(".
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values",
                 "bottomk", "topk", "quantile", "limitk", "limit_ratio"}


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        assert m, f"cannot read PromQL at {expr[pos:pos + 20]!r} in {expr!r}"
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
        pos = m.end()
    return out


def _selectors(expr: str) -> list[tuple[str | None, list[tuple[str, str, str]]]]:
    """[(metric name or None, [(label, op, value), ...])] for every vector selector in `expr`."""
    toks, out, i = _tokens(expr), [], 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else None
        if kind == "ident" and text in _LABEL_LIST_KEYWORDS and nxt == "(":
            i = next(j for j in range(i, len(toks)) if toks[j][1] == ")") + 1
            continue
        if kind == "ident" and (nxt == "(" or text.lower() in _KEYWORDS | _AGGREGATIONS):
            i += 1
            continue
        name = text if kind == "ident" else None
        if kind == "ident" or text == "{":
            matchers = []
            j = i + 1 if kind == "ident" else i
            if j < len(toks) and toks[j][1] == "{":
                j += 1
                while toks[j][1] != "}":
                    if toks[j][1] == ",":
                        j += 1
                        continue
                    label, op, value = toks[j][1], toks[j + 1][1], toks[j + 2][1]
                    matchers.append((label, op, value[1:-1]))
                    j += 3
                j += 1
            out.append((name, matchers))
            i = j
            continue
        i += 1
    return out


def _check_selector(name, matchers, where: str) -> None:
    named = [v for label, op, v in matchers if label == "__name__" and op == "="]
    name = name or (named[0] if named else None)
    assert name, f"{where}: selector without a metric name"
    if name in PROMETHEUS_SERIES:
        return
    exported = _exported()
    assert name in exported, f"{where}: {name} is not exported by kvhold/metrics.py"
    for label, op, value in matchers:
        if label in TARGET_LABELS:
            continue
        assert label in exported[name], f"{where}: {name} has no label {label!r} (has {sorted(exported[name])})"
        known = exported[name][label] if label == "le" else _known_label_values().get(label)
        if known is None:
            continue
        values = value.split("|") if op in ("=~", "!~") and re.fullmatch(r"[\w|]+", value) else \
            ([value] if op in ("=", "!=") else [])
        for v in values:
            assert v in known, f"{where}: {name}{{{label}{op}\"{value}\"}}: {v!r} never occurs (known: {sorted(known)})"


def _rules():
    for path, doc in _docs(RULE_FILES):
        assert set(doc) == {"groups"}, f"{path.name}: a rule file holds only `groups:`"
        for group in doc["groups"]:
            assert group["name"] and group["rules"], path.name
            for rule in group["rules"]:
                yield path, group, rule


def test_rules_are_well_formed():
    names = []
    for path, group, rule in _rules():
        assert ("alert" in rule) != ("record" in rule), f"{path.name}: {rule}"
        assert isinstance(rule.get("expr"), str) and rule["expr"].strip()
        if "for" in rule:
            assert re.fullmatch(r"(\d+[smhdwy])+", rule["for"]), rule["for"]
        if "alert" in rule:
            names.append(rule["alert"])
            assert rule.get("labels", {}).get("severity") in ("critical", "warning", "info"), rule["alert"]
            assert {"summary", "description"} <= set(rule.get("annotations", {})), rule["alert"]
        else:
            assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]
    assert len(names) == len(set(names)), "duplicate alert names"
    wanted = {"KvholdRecoverySlow", "KvholdKvPagesBad", "KvholdExecutorRestartStorm", "KvholdNvmlEscalation",
              "KvholdNoExecutorServing"}
    assert wanted <= set(names), f"missing alerts: {wanted - set(names)}"


def test_rules_use_only_exported_metrics_and_labels():
    for path, group, rule in _rules():
        where = f"{path.name} {rule.get('alert') or rule.get('record')}"
        selectors = _selectors(rule["expr"])
        assert selectors, f"{where}: no series in {rule['expr']!r}"
        for name, matchers in selectors:
            _check_selector(name, matchers, where)


def test_the_promql_reader_catches_mistakes():
    with pytest.raises(AssertionError, match="not exported"):
        _check_selector(*_selectors('rate(kvhold_recovery_seconds_totl[5m])')[0], "t")
    with pytest.raises(AssertionError, match="no label"):
        _check_selector(*_selectors('kvhold_kv_pages{phase="free"}')[0], "t")
    with pytest.raises(AssertionError, match="never occurs"):
        _check_selector(*_selectors('kvhold_nvml_health_action{action=~"drain|reboot"}')[0], "t")
    with pytest.raises(AssertionError, match="never occurs"):
        _check_selector(*_selectors('kvhold_recovery_seconds_bucket{le="0.3"}')[0], "t")
    sel = _selectors('sum without (reason) (increase(kvhold_executor_restarts_total{reason!="exited"}[10m])) > 5')
    assert sel == [("kvhold_executor_restarts_total", [("reason", "!=", "exited")])]
