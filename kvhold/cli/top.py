"""`kvhold top`: a live terminal view of one running sidecar.

`render(status)` turns one status dict (what `kvhold status --json` prints) into a
rich renderable: the header (weights, requests, health), a line of throughput, time to
first token, running and waiting requests, the executors, the KV page pool as a heatmap
of the sidecar's `page_map`, recent recoveries with their timings, and recent events.
The frame fits the terminal (80x24 at the least): the heatmap and the tables take the rows
left. Each page state has its own glyph as well as its colour, so the map reads the same
without colour (NO_COLOR, a log). `run_top` polls the sidecar every `interval` seconds and
redraws with rich Live (`q` quits, as does Ctrl-C); while the sidecar does not answer, the
last frame stays, marked stale with how long it has been. `once` prints a single frame.
Event times are CLOCK_MONOTONIC, shared with the sidecar because top runs on its host.
"""
from __future__ import annotations

import os
import select
import sys
import time
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvhold.protocol.page_map import LEGEND

HEATMAP_WIDTH = 64
HEATMAP_ROWS = 16
CELL_STYLE = {".": "grey35", "+": "green4", "#": "green1", "q": "magenta", "w": "yellow", "x": "bold red"}
CELL_GLYPH = {".": "·", "+": "▒", "#": "█", "q": "?", "w": "~", "x": "X"}   # legible without colour
MIN_SIZE = (80, 24)
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
    finished = ", ".join(f"{k} {v}" for k, v in (req.get("finished") or {}).items()) or "none"
    text = Text.assemble(
        ("kvhold ", "bold"), (str(status.get("instance")), "cyan"),
        f"  pid {status.get('pid')}  generation {status.get('generation')}  "
        f"up {status.get('uptime_s', 0):.0f}s  weights {w.get('state')}",
        f" ({w['load_ms']:.0f} ms)" if w.get("load_ms") else "",
        f"\nrequests: {req.get('admitted_total', 0)} admitted, finished: {finished}")
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


def _table(*columns: str, title: str) -> Table:
    """A table of one line per row (no borders): the frame must fit 24 lines."""
    return Table(*columns, title=title, title_justify="left", title_style="bold", expand=False,
                 box=None, pad_edge=False, padding=(0, 1), header_style="bold underline")


@dataclass
class Rates:
    """What two successive frames tell: tokens per second since the previous status."""
    tokens_per_s: float | None = None
    _last: tuple[float, int] | None = None

    def update(self, status: dict, now_s: float | None = None) -> "Rates":
        now_s = time.monotonic() if now_s is None else now_s
        tokens = (status.get("requests") or {}).get("tokens_total")
        if tokens is not None:
            if self._last is not None and now_s > self._last[0]:
                self.tokens_per_s = max(0.0, (tokens - self._last[1]) / (now_s - self._last[0]))
            self._last = (now_s, tokens)
        return self


def load_line(status: dict, rates: Rates | None = None) -> Text:
    req = status.get("requests") or {}
    running = req.get("in_flight", 0) - (req.get("waiting") or 0)
    tps = rates.tokens_per_s if rates is not None else None
    ttft = req.get("first_token_ms_p50")
    line = Text.assemble(
        "throughput ", (f"{tps:.0f} tok/s" if tps is not None else "-", "bold"),
        "   first token P50 ", (f"{ttft:.0f} ms" if ttft is not None else "-", "bold"),
        "   running ", (str(running), "bold"), "   waiting ", (str(req.get("waiting", 0)), "bold"))
    cache = status.get("prefix_cache")
    if cache:
        line.append_text(Text.assemble("   prefix cache hits ", (_percent(cache.get("hit_rate")), "bold")))
    return line


def _percent(rate) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}%"


def executors_table(status: dict) -> Table:
    table = _table("lease", "pid", "role", "epoch", "heartbeat age", "steps", "ready", title="executors")
    for ex in status.get("executors", []):
        age = ex.get("heartbeat_age_ms", 0.0)
        age_style = "green" if age < 250 else "yellow" if age < 1000 else "bold red"
        table.add_row(str(ex.get("slot")), str(ex.get("pid")),
                      Text(str(ex.get("role")), ROLE_STYLE.get(ex.get("role"), "")),
                      str(ex.get("epoch")), Text(f"{age:.0f} ms", age_style), str(ex.get("steps")),
                      "yes" if ex.get("ready") else "no")
    return table


def heatmap(status: dict, width: int = HEATMAP_WIDTH, rows: int = HEATMAP_ROWS) -> Group:
    """The page pool: one glyph per cell, at most `width` x `rows` cells, then the legend."""
    pages = status.get("pages") or {}
    counts = Text("pages: " + "  ".join(f"{k} {v}" for k, v in pages.items()))
    pmap = status.get("page_map")
    if not pmap:
        return Group(counts)
    cells, step = _fold(pmap["cells"], width * rows)
    per_cell = pmap["pages_per_cell"] * step
    grid = Text()
    for start in range(0, len(cells), width):
        if start:
            grid.append("\n")
        for ch in cells[start:start + width]:
            grid.append(CELL_GLYPH.get(ch, ch), CELL_STYLE.get(ch, ""))
    legend = Text(f"cell={per_cell}p ")
    for ch, name in LEGEND.items():
        legend.append(CELL_GLYPH[ch], CELL_STYLE[ch])
        legend.append(f"{name.replace('partly committed', 'partly').replace('being written', 'writing')} ")
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
    table = _table("epochs", "pid", "promote", "valid", "resume", "1st", "ok/bad", "r/d/l", "recomp",
                   title="recoveries (ms after detection)")
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
    table = _table("age", "event", "lease", "pid", "epoch", "detail", title="recent events")
    for ev in status.get("events", [])[-limit:][::-1]:
        detail = ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in ev.items()
                           if k not in ("kind", "ns", "slot", "pid", "epoch") and not k.endswith("_ns"))
        table.add_row(_age(ev.get("ns", now_ns), now_ns), str(ev.get("kind")), str(ev.get("slot", "")),
                      str(ev.get("pid", "")), str(ev.get("epoch", "")), detail[:36])
    return table


def render(status: dict, now_ns: int | None = None, *, size: tuple[int, int] | None = None,
           rates: Rates | None = None, stale_s: float | None = None) -> Group:
    """One frame for a terminal of `size` (columns, lines; default 80x24 at the least and
    the heatmap at full size when there is room); `stale_s`: the status is that old."""
    now_ns = time.monotonic_ns() if now_ns is None else now_ns
    width, height = size or (HEATMAP_WIDTH + 16, 60)
    width, height = max(width, MIN_SIZE[0]), max(height, MIN_SIZE[1])
    head = header(status)
    recoveries = status.get("recoveries", [])
    events = status.get("events", [])
    fixed = (len(head.wrap(Console(width=width), width)) + 1             # the header, the load line
             + 2 + len(status.get("executors", []))                     # title, column names, rows
             + 3                                                        # the pool: title, counts, legend
             + (1 if stale_s is not None else 0)
             + 2 + 2)                                                   # the two tables' titles and names
    spare = max(0, height - 1 - fixed)               # the last line stays free for the cursor
    n_rec = min(len(recoveries), 3, spare // 4)
    n_ev = min(len(events), 8, (spare - n_rec) // 3)
    map_width = min(HEATMAP_WIDTH, width - 2)
    map_rows = max(1, min(HEATMAP_ROWS, spare - n_rec - n_ev))
    parts = []
    if stale_s is not None:
        parts.append(Text(f"STALE: the sidecar has not answered for {stale_s:.0f} s; "
                          f"this is its last status", "bold red"))
    parts += [head, load_line(status, rates), executors_table(status),
              Text("KV page pool", "bold"), heatmap(status, map_width, map_rows),
              recoveries_table(status, n_rec), events_table(status, now_ns, n_ev)]
    return Group(*parts)


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

    rates, last, last_ok = Rates(), None, time.monotonic()
    with _Keys() as keys, Live(console=console, screen=False, auto_refresh=False) as live:
        try:
            while True:
                size = (console.size.width, console.size.height)
                try:
                    last, last_ok = client.status(), time.monotonic()
                    frame = render(last, size=size, rates=rates.update(last))
                except SidecarUnavailable as exc:
                    frame = (render(last, size=size, rates=rates, stale_s=time.monotonic() - last_ok)
                             if last is not None else render_error(str(exc)))
                live.update(frame, refresh=True)
                if keys.quit_within(interval):
                    return 0
        except KeyboardInterrupt:
            return 0


class _Keys:
    """Single keys from a terminal on stdin (cbreak mode while top runs): `q` quits."""

    def __init__(self):
        self._fd, self._saved = None, None

    def __enter__(self) -> "_Keys":
        try:
            import termios
            import tty
            if sys.stdin.isatty():
                self._fd = sys.stdin.fileno()
                self._saved = termios.tcgetattr(self._fd)
                tty.setcbreak(self._fd)
        except (ImportError, OSError, ValueError):
            self._fd = None
        return self

    def quit_within(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s`; True if `q` was pressed meanwhile."""
        if self._fd is None:
            time.sleep(timeout_s)
            return False
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self._fd], [], [], left)[0]:
                key = os.read(self._fd, 32)
                if not key:                     # stdin closed: no more keys, keep going
                    self._fd = None
                    time.sleep(max(0.0, deadline - time.monotonic()))
                    return False
                if b"q" in key.lower():
                    return True
        return False

    def __exit__(self, *exc) -> None:
        if self._fd is not None and self._saved is not None:
            import termios
            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)
