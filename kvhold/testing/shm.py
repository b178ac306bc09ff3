"""Shared-memory objects of test instances: what a test leaves in /dev/shm, and their removal.

A sidecar stopped cleanly unlinks its objects; one killed (SIGKILL) leaves them on purpose, for
the next sidecar of its instance to re-adopt or remove (kvhold.sidecar.instance_lock,
`remove_stale`). A test that kills a sidecar and starts none after it removes them itself
(`remove_instance_shm`, which the harnesses call once every process of the instance is gone)."""
from __future__ import annotations

import os
import re
from pathlib import Path

import posix_ipc

from kvhold.protocol.naming import SHM_PREFIX

SHM_DIR = Path("/dev/shm")


def instance_segments(instance: str) -> list[str]:
    """The /dev/shm names of `instance`'s objects (not those of an instance whose name extends
    it: "a" is a prefix of "a-b")."""
    prefix = f"{SHM_PREFIX}-{os.getuid()}-{instance}-"
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.glob(prefix + "*") if "-" not in p.name[len(prefix):])


def remove_instance_shm(instance: str) -> list[str]:
    """Unlink every shm object of `instance` (its processes gone); the names removed."""
    removed = []
    for name in instance_segments(instance):
        try:
            posix_ipc.unlink_shared_memory("/" + name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            pass
    return removed


def made_by(pid: int) -> set[str]:
    """The /dev/shm names that carry `pid` the way the test harnesses and fixtures name their
    objects: instances `t<pid>-N`, `s<pid>-N`, `http<pid>-N` (kvhold.testing) and the tests' own
    `kvhold-test-<what>-<pid>[-N]` objects."""
    if not SHM_DIR.is_dir():
        return set()
    own = re.compile(rf"^{SHM_PREFIX}-(?:\d+-(?:t|s|http){pid}-|test-(?:[a-z-]*-)?{pid}(?:-|$))")
    return {p.name for p in SHM_DIR.iterdir() if own.match(p.name)}
