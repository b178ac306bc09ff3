"""Write tests/durations.json from JUnit XML reports: each test's seconds (setup, call and
teardown), so that the test suites can hand the longest test files out first (tests/conftest.py).

    python3 -m pytest -q -m slow --junitxml=/tmp/slow.xml
    python3 -m tools.test_durations /tmp/slow.xml [more.xml ...]

Tests the reports do not name keep their recorded seconds; a test with none counts as
tests/conftest.py's UNKNOWN_TEST_S when the files are ordered.
"""
from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"


def durations(report: Path) -> dict[str, float]:
    out = {}
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        name = case.get("name", "")
        if module and name:
            out[f"{module}.py::{name}"] = round(float(case.get("time") or 0.0), 2)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", type=Path, help="JUnit XML reports (pytest --junitxml)")
    args = parser.parse_args(argv)
    known = json.loads(OUT.read_text()) if OUT.exists() else {}
    for report in args.reports:
        known.update(durations(report))
    OUT.write_text(json.dumps(dict(sorted(known.items())), indent=0) + "\n")
    print(f"{OUT}: {len(known)} tests")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
