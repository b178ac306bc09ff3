"""`kvhold failovers`: a picture of a running sidecar's failovers, as an SVG (or an HTML page
holding it and a table).

Above, the largest gap between two tokens of one stream, second by second, as the clients
received them (the frontend's `token_gaps`, the last ten minutes), with the tokens streamed
each second in grey behind; a red line marks each executor failover the sidecar recorded
(`recoveries`: detection), labelled with its detection -> first resumed token. Below, each
failover's phases, from its detection: fenced, promoted, validated, resumed, first token.
Every figure is the sidecar's own record, on CLOCK_MONOTONIC; nothing is estimated.
"""
from __future__ import annotations

import html
from pathlib import Path

WIDTH, TOP_H, ROW_H, LEFT, RIGHT = 900, 260, 22, 70, 20
PHASES = (("promoted_ns", "promoted", "#4c78a8"), ("validated_ns", "validated", "#f58518"),
          ("resumed_ns", "resumed", "#54a24b"), ("first_token_ns", "first token", "#e45756"))


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def render_svg(status: dict) -> str:
    gaps = (status.get("token_gaps") or {}).get("series") or []
    bucket_ns = int((status.get("token_gaps") or {}).get("bucket_ms", 1000) * 1e6)
    recs = [r for r in status.get("recoveries", []) if r.get("detect_ns")]
    starts = [b[0] for b in gaps] + [r["detect_ns"] for r in recs]
    if not starts:
        return _svg(WIDTH, 60, ['<text x="10" y="35" font-size="14">no streamed tokens and no failover '
                                'recorded yet</text>'])
    t0, t1 = min(starts), max(starts) + bucket_ns
    span = max(1, t1 - t0)
    plot_w = WIDTH - LEFT - RIGHT

    def x(ns: int) -> float:
        return LEFT + plot_w * (ns - t0) / span

    top_gap = max([b[1] for b in gaps] + [1.0])
    top_tokens = max([b[2] for b in gaps] + [1])
    out = [f'<text x="{LEFT}" y="16" font-size="13" font-weight="bold">largest inter-token gap per '
           f'second, as streamed (ms); tokens per second in grey</text>']
    base = TOP_H - 30
    for start, gap_ms, tokens, _ in gaps:         # tokens per second, behind
        h = (base - 30) * tokens / top_tokens
        out.append(f'<rect x="{x(start):.1f}" y="{base - h:.1f}" width="{max(1.0, plot_w * bucket_ns / span):.1f}" '
                   f'height="{h:.1f}" fill="#dddddd"/>')
    points = " ".join(f"{x(start + bucket_ns // 2):.1f},{base - (base - 30) * gap_ms / top_gap:.1f}"
                      for start, gap_ms, _, _ in gaps)
    if points:
        out.append(f'<polyline points="{points}" fill="none" stroke="#333333" stroke-width="1.5"/>')
    out.append(f'<line x1="{LEFT}" y1="{base}" x2="{WIDTH - RIGHT}" y2="{base}" stroke="#000"/>')
    out.append(f'<text x="{LEFT - 5}" y="35" font-size="11" text-anchor="end">{top_gap:.0f}</text>')
    out.append(f'<text x="{LEFT - 5}" y="{base}" font-size="11" text-anchor="end">0</text>')
    out.append(f'<text x="{WIDTH - RIGHT}" y="{base + 15}" font-size="11" text-anchor="end">'
               f'{span / 1e9:.0f} s</text>')
    for r in recs:
        xr = x(r["detect_ns"])
        first = r.get("first_token_ns")
        label = f"failover: {_ms(first - r['detect_ns'])}" if first else "failover"
        out.append(f'<line x1="{xr:.1f}" y1="25" x2="{xr:.1f}" y2="{base}" stroke="#d62728" stroke-width="1"/>')
        out.append(f'<text x="{xr + 3:.1f}" y="30" font-size="11" fill="#d62728">{html.escape(label)}</text>')
    # the phases of each failover, from its detection
    y = TOP_H + 10
    out.append(f'<text x="{LEFT}" y="{y}" font-size="13" font-weight="bold">each failover from its '
               f'detection: ' + ", ".join(f'<tspan fill="{c}">{n}</tspan>' for _, n, c in PHASES) + "</text>")
    longest = max([(r.get("first_token_ns") or r.get("resumed_ns") or r["detect_ns"]) - r["detect_ns"]
                   for r in recs] + [1])
    for i, r in enumerate(recs[-20:]):
        yy = y + 10 + i * ROW_H
        out.append(f'<text x="{LEFT - 5}" y="{yy + 13}" font-size="11" text-anchor="end">'
                   f'{r.get("fenced_epoch")}→{r.get("epoch")}</text>')
        prev = 0
        for field, _, color in PHASES:
            if not r.get(field):
                continue
            at = r[field] - r["detect_ns"]
            w = plot_w * max(0, at - prev) / longest
            out.append(f'<rect x="{LEFT + plot_w * prev / longest:.1f}" y="{yy}" width="{w:.1f}" height="16" '
                       f'fill="{color}"/>')
            prev = max(prev, at)
        out.append(f'<text x="{LEFT + plot_w * prev / longest + 4:.1f}" y="{yy + 13}" font-size="11">'
                   f'{_ms(prev)}; {r.get("requests_resumable", 0)} resumable, {r.get("requests_damaged", 0)} '
                   f'damaged, {r.get("requests_lost", 0)} lost, {r.get("tokens_recomputed", 0)} tokens '
                   f'recomputed</text>')
    height = y + 20 + ROW_H * min(len(recs), 20)
    return _svg(WIDTH, height, out)


def _svg(width: int, height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif">\n' + "\n".join(body) + "\n</svg>\n")


def render_html(status: dict) -> str:
    rows = []
    for r in status.get("recoveries", []):
        d = r.get("detect_ns")
        if not d:
            continue
        cells = [f"{r.get('fenced_epoch')}→{r.get('epoch')}"] + [
            _ms(r[f] - d) if r.get(f) else "-" for f, _, _ in PHASES] + [
            str(r.get(f"requests_{c}", 0)) for c in ("resumable", "damaged", "lost")] + [
            str(r.get("tokens_recomputed", 0))]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("epochs", "promoted", "validated", "resumed", "first token",
                                             "resumable", "damaged", "lost", "recomputed"))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>kvhold failovers: "
            f"{html.escape(str(status.get('instance', '')))}</title></head><body>\n"
            f"<h2>kvhold failovers: instance {html.escape(str(status.get('instance', '')))}</h2>\n"
            f"{render_svg(status)}<table border='1' cellpadding='3'><tr>{head}</tr>{''.join(rows)}</table>\n"
            "</body></html>\n")


def cmd_failovers(args) -> int:
    from kvhold.cli.status_view import fetch_status

    status = fetch_status(args, "failovers")
    if status is None:
        return 1
    out = Path(args.out)
    out.write_text(render_html(status) if out.suffix in (".html", ".htm") else render_svg(status))
    n = sum(1 for r in status.get("recoveries", []) if r.get("detect_ns"))
    print(f"wrote {out}: {n} failover(s), {len((status.get('token_gaps') or {}).get('series') or [])} s of "
          "streaming")
    return 0
