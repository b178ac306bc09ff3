"""`kvhold top`: a live terminal view of one running sidecar.

`render(status)` turns one status dict (what `kvhold status --json` prints) into a
rich renderable: the header (weights, requests, health), the executors, the KV
page pool as a heatmap of the sidecar's `page_map`, recent recoveries with their
timings, and recent events. `run_top` polls the sidecar every `interval` seconds
and redraws with rich Live, or prints a single frame with `once`. Event times are
CLOCK_MONOTONIC, shared with the sidecar because top runs on its host.
"""
from __future__ import annotations

import sys
import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvhold.protocol.page_map import LEGEND

HEATMAP_WIDTH = 64
HEATMAP_ROWS = 16
CELL_STYLE = {".": "grey35", "+": "green4", "#": "green1", "q": "magenta", "w": "yellow", "x": "bold red"}
ROLE_STYLE = {"active": "bold green", "standby": "cyan", "starting": "yellow"}


def _ms(ns: float) -> str:
    return f"{ns / 1e6:.1f}"


def _age(ns: int, now_ns: int) -> str:
    seconds = max(0.0, (now_ns - ns) / 1e9)
    return f"{seconds:.1f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


# ---------------------------------------------------------------------- sections
def header(status: dict) -> Text:
    w = status.get("weights") or {}
    req = status.get("requests") or {}
    text = Text.assemble(
        ("kvhold ", "bold"), (str(status.get("instance")), "cyan"),
        f"  pid {status.get('pid')}  generation {status.get('generation')}  "
        f"up {status.get('uptime_s', 0):.0f}s\n",
        f"weights {w.get('state')}", f" ({w['load_ms']:.0f} ms)" if w.get("load_ms") else "",
        f"   requests: {req.get('in_flight', 0)} in flight, {req.get('admitted_total', 0)} admitted, "
        f"finished {req.get('finished', {})}")
    health = status.get("health")
    if health is not None:
        text.append("\n")
        text.append_text(health_line(health))
    return text


def health_line(health) -> Text:
    if not isinstance(health, dict):
        return Text(f"health: {health}")
    action = health.get("action") or health.get("state") or "-"
    style = "green" if str(action).lower() in ("none", "ok", "healthy", "-") else "bold red"
    source = health.get("source")
    source = source.get("source", "?") if isinstance(source, dict) else source
    line = Text.assemble("health: ", (str(action), style), f"  source {source}")
    for key in ("reason", "error"):
        if health.get(key):
            line.append(f"  {key}: {health[key]}")
    return line


def executors_table(status: dict) -> Table:
    table = Table("slot", "pid", "role", "epoch", "heartbeat age", "steps", "ready",
                  title="executors", title_justify="left", expand=False)
    for ex in status.get("executors", []):
        age = ex.get("heartbeat_age_ms", 0.0)
        age_style = "green" if age < 250 else "yellow" if age < 1000 else "bold red"
        table.add_row(str(ex.get("slot")), str(ex.get("pid")),
                      Text(str(ex.get("role")), ROLE_STYLE.get(ex.get("role"), "")),
                      str(ex.get("epoch")), Text(f"{age:.0f} ms", age_style), str(ex.get("steps")),
                      "yes" if ex.get("ready") else "no")
    return table


def heatmap(status: dict, width: int = HEATMAP_WIDTH, rows: int = HEATMAP_ROWS) -> Group:
    pages = status.get("pages") or {}
    counts = Text("pages: " + "  ".join(f"{k} {v}" for k, v in pages.items()))
    pmap = status.get("page_map")
    if not pmap:
        return Group(counts)
    cells, step = _fold(pmap["cells"], width * rows)
    per_cell = pmap["pages_per_cell"] * step
    grid = Text()
    for start in range(0, len(cells), width):
        for ch in cells[start:start + width]:
            grid.append("█", CELL_STYLE.get(ch, ""))
        grid.append("\n")
    legend = Text(f"one cell = {per_cell} page{'s' if per_cell > 1 else ''}   ")
    for ch, name in LEGEND.items():
        legend.append("█", CELL_STYLE[ch])
        legend.append(f" {name}  ")
    return Group(counts, grid, legend)


def _fold(cells: str, limit: int) -> tuple[str, int]:
    """Merge runs of `step` neighbouring cells so at most `limit` remain; the rarer state wins."""
    if len(cells) <= limit:
        return cells, 1
    step = -(-len(cells) // limit)
    rank = {ch: i for i, ch in enumerate(".+#qwx")}
    out = []
    for i in range(0, len(cells), step):
        chunk = cells[i:i + step]
        worst = max(chunk, key=rank.__getitem__)
        if worst in "+#" and len(set(chunk)) > 1:
            worst = "+"
        out.append(worst)
    return "".join(out), step


def recoveries_table(status: dict, limit: int = 5) -> Table:
    table = Table("epochs", "pid", "promote", "validate", "resume", "1st token", "pages ok/bad",
                  "res/dmg/lost", "recomp", title="recent recoveries (ms after detection; "
                  "requests resumable/damaged/lost, tokens recomputed)", title_justify="left")
    for rec in status.get("recoveries", [])[-limit:]:
        detect = rec.get("detect_ns") or rec.get("promoted_ns", 0)
        first = rec.get("first_token_ns")
        table.add_row(
            f"{rec.get('fenced_epoch')}→{rec.get('epoch')}", str(rec.get("pid")),
            _ms(rec.get("promoted_ns", detect) - detect), _ms(rec.get("validated_ns", detect) - detect),
            _ms(rec.get("resumed_ns", detect) - detect), _ms(first - detect) if first else "-",
            f"{rec.get('pages_checked', 0) - rec.get('pages_bad', 0)}/{rec.get('pages_bad', 0)}",
            f"{rec.get('requests_resumable', 0)}/{rec.get('requests_damaged', 0)}/"
            f"{rec.get('requests_lost', 0)}", str(rec.get("tokens_recomputed", 0)))
    return table


def events_table(status: dict, now_ns: int, limit: int = 8) -> Table:
    table = Table("age", "event", "slot", "pid", "epoch", "detail", title="recent events",
                  title_justify="left")
    for ev in status.get("events", [])[-limit:][::-1]:
        detail = ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in ev.items()
                           if k not in ("kind", "ns", "slot", "pid", "epoch") and not k.endswith("_ns"))
        table.add_row(_age(ev.get("ns", now_ns), now_ns), str(ev.get("kind")), str(ev.get("slot", "")),
                      str(ev.get("pid", "")), str(ev.get("epoch", "")), detail[:60])
    return table


def render(status: dict, now_ns: int | None = None) -> Group:
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    return Group(
        Panel(header(status), expand=False),
        executors_table(status),
        Panel(heatmap(status), title="KV page pool", title_align="left", expand=False),
        recoveries_table(status),
        events_table(status, now_ns))


def render_error(message: str) -> Text:
    return Text(f"kvhold top: {message} (retrying)", "bold red")


# ---------------------------------------------------------------------- loop
def run_top(instance: str, runtime_root=None, *, interval: float = 1.0, once: bool = False,
            timeout: float = 5.0, console: Console | None = None) -> int:
    from kvhold.client.client import Client
    from kvhold.protocol.errors import KvholdError

    console = console or Console()
    with Client.for_instance(instance, runtime_root, timeout=timeout) as client:
        if once:
            try:
                console.print(render(client.status()))
            except KvholdError as exc:
                print(f"kvhold top: {exc}", file=sys.stderr)
                return 1
            return 0
        return _live(client, console, max(0.1, interval))


def _live(client, console: Console, interval: float) -> int:
    from kvhold.protocol.errors import SidecarUnavailable

    with Live(console=console, screen=False, auto_refresh=False) as live:
        try:
            while True:
                try:
                    frame = render(client.status())
                except SidecarUnavailable as exc:
                    frame = render_error(str(exc))
                live.update(frame, refresh=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0
