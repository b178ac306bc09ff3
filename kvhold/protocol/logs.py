"""Logging setup for kvhold processes: one line per record, with role, pid and epoch.

Only entry points call `setup_logging`; library modules just use
`logging.getLogger(__name__)`.
"""
from __future__ import annotations

import logging
import sys

_context = {"role": "-", "epoch": 0}


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.role = _context["role"]
        record.epoch = _context["epoch"]
        return True


def set_log_context(role: str | None = None, epoch: int | None = None) -> None:
    if role is not None:
        _context["role"] = role
    if epoch is not None:
        _context["epoch"] = epoch


def setup_logging(level: str = "INFO", role: str = "-") -> None:
    set_log_context(role=role)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(logging.Formatter(
        "%(asctime)s.%(msecs)03d %(levelname).1s [%(role)s pid=%(process)d e=%(epoch)d] "
        "%(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
