"""`kvhold top`'s frame: fits 80x24, page states told apart without colour, the load line
and the stale mark, and the lease column named as `kvhold status` names it."""
from rich.console import Console

from kvhold.cli.top import CELL_GLYPH, Rates, render
from kvhold.protocol.page_map import LEGEND


def status(executors=2, recoveries=4, events=10) -> dict:
    return {"instance": "inst", "pid": 1, "generation": 1, "uptime_s": 3.0,
            "weights": {"state": "sealed", "load_ms": 12.0},
            "requests": {"in_flight": 5, "admitted_total": 9, "finished": {"length": 4}, "waiting": 2,
                         "tokens_total": 1000, "first_token_ms_p50": 12.3},
            "executors": [{"slot": i, "pid": 10 + i, "role": "active" if i == 0 else "standby",
                           "epoch": 3 + i, "heartbeat_age_ms": 5.0, "steps": 100, "ready": True}
                          for i in range(executors)],
            "pages": {"free": 500, "committed": 12, "total": 4096},
            "page_map": {"pages_per_cell": 1, "cells": "." * 1000 + "+" * 500 + "#" * 2000 + "q" * 200 + "w" * 200 + "x" * 196},
            "recoveries": [{"fenced_epoch": 1, "epoch": 2, "pid": 11, "detect_ns": 0, "promoted_ns": 1e6,
                            "validated_ns": 2e6, "resumed_ns": 3e6, "first_token_ns": 4e6,
                            "pages_checked": 10, "pages_bad": 1, "requests_resumable": 3}] * recoveries,
            "events": [{"kind": "fence", "ns": 0, "slot": 0, "pid": 10, "epoch": 1, "reason": "died"}] * events,
            "health": {"action": "none", "source": "nvml"}}


def frame(st, size=(80, 24), **kw) -> str:
    console = Console(record=True, width=size[0], height=size[1], force_terminal=False, no_color=True)
    console.print(render(st, now_ns=5, size=size, **kw))
    return console.export_text()


def test_the_frame_fits_80_by_24_with_every_section():
    for st in (status(), status(executors=4, recoveries=9, events=30), status(executors=1, recoveries=0)):
        for stale in (None, 3.0):
            text = frame(st, stale_s=stale)
            lines = text.rstrip("\n").split("\n")
            assert len(lines) <= 23 and max(map(len, lines)) <= 80, text
            assert "executors" in text and "KV page pool" in text and "recent events" in text
            assert ("STALE" in text) == (stale is not None)


def test_a_larger_terminal_gets_a_larger_map():
    small, large = frame(status()), frame(status(), size=(160, 60))
    assert large.count(CELL_GLYPH["#"]) > small.count(CELL_GLYPH["#"])


def test_page_states_have_distinct_glyphs_in_the_map_and_legend():
    assert len(set(CELL_GLYPH.values())) == len(LEGEND) == len(CELL_GLYPH)
    text = frame(status(), size=(120, 40))
    legend = next(line for line in text.split("\n") if "free" in line and "bad" in line)
    for ch in LEGEND:
        assert CELL_GLYPH[ch] in legend
    for glyph in CELL_GLYPH.values():
        assert glyph in text.split("KV page pool")[1].split("cell=")[0]


def test_the_load_line_counts_from_two_frames_and_the_lease_column():
    rates = Rates()
    st = status()
    rates.update(st, now_s=10.0)
    st["requests"] = dict(st["requests"], tokens_total=1500)
    text = frame(st, rates=rates.update(st, now_s=12.0))
    assert "throughput 250 tok/s" in text and "first token P50 12 ms" in text
    assert "running 3" in text and "waiting 2" in text
    assert "lease" in text.split("executors")[1].split("\n")[1]
