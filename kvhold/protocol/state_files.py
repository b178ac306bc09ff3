"""State files read back after a restart: a damaged one is set aside, never fatal.

kvhold keeps a few small files that outlive their process and reads them back at the next
start. Each format has one owner that checks every field's type and range when it reads a
file back (a dataclass with a `from_json`/`from_doc`), raising StateFileError with the reason:
* `request_deaths.json` (beside the durable journal): kvhold.sidecar.request_deaths.DeathCounts;
* `results/<id>.kept` (beside the durable journal): kvhold.frontend.kept_results.KeptRecord;
* `generation` (the runtime directory and the durable journal's): `read_generation` here;
* `last-drain.json` (the durable journal's): kvhold.sidecar.pool_restart.DrainRecord;
* the durable journal's records: kvhold.sidecar.durable_journal.decode_record (a damaged one is
  moved to `failed/` with its reason, and its request reported failed);
* the hold record of a drained sidecar: kvhold.protocol.naming.InstancePaths.release_hold;
* `lock` and `spare-<pid>` (the runtime directory): read as a pid where one is digits, else
  none (kvhold.sidecar.instance_lock, InstancePaths.spare_pids).
A file that does not hold what its writer writes (damaged on disk, edited by hand, written by
another build) is renamed `<name>.bad` beside it by `set_aside`, with one log line naming the
reason, and its reader goes on as if it were absent; a later `.bad` of the same name replaces
the earlier one.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
BAD_SUFFIX = ".bad"
MAX_GENERATION = (1 << 24) - 1     # request ids are the generation above 40 bits of a counter


class StateFileError(ValueError):
    """A state file read back does not hold what its writer writes: the reason."""


def set_aside(path: Path, reason: str, what: str) -> Path | None:
    """Rename the damaged file `path` to `<name>.bad` and log why; the new path, or None if it
    could not be moved (then it is removed, so that the next start does not trip on it)."""
    path = Path(path)
    dest = path.with_name(path.name + BAD_SUFFIX)
    try:
        os.replace(path, dest)
    except FileNotFoundError:
        return None
    except OSError as exc:
        log.error("%s %s is damaged (%s) and could not be set aside (%s): removed", what, path, reason, exc)
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass
        return None
    log.error("%s %s is damaged (%s): set aside as %s, and not used", what, path, reason, dest.name)
    return dest


def integer(value, name: str, low: int, high: int) -> int:
    """`value` if it is an integer (not a bool) in [low, high], else StateFileError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StateFileError(f"{name} is not an integer ({type(value).__name__})")
    if not low <= value <= high:
        shown = value if abs(value) < 10**30 else f"an integer of {value.bit_length()} bits"
        raise StateFileError(f"{name} {shown} is not in [{low}, {high}]")
    return value


def read_generation(path: Path) -> int:
    """The pool generation kept in `path` (written as one decimal line), 0 if there is none; a
    damaged file is set aside and counts as none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return 0
    except (OSError, UnicodeDecodeError) as exc:
        set_aside(path, f"unreadable: {exc}", "the pool generation file")
        return 0
    try:
        value = int(text.strip())
    except ValueError:
        set_aside(path, f"not a decimal integer: {text[:40]!r}", "the pool generation file")
        return 0
    try:
        return integer(value, "generation", 0, MAX_GENERATION)
    except StateFileError as exc:
        set_aside(path, str(exc), "the pool generation file")
        return 0
