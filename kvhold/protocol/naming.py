"""Where one kvhold instance lives on a host: its runtime directory and shm names.

Every name is derived from (uid, instance) so two sidecars on one host, or two
users, never clash. The runtime directory is owner-only (0700) and holds the
sockets, the executor token, the instance lock and, while a pool restart waits
for the operator, its hold file (a record the new image waits on until it is
released); shm objects are named
``/kvhold-<uid>-<instance>-<what>`` and created 0600 by the sidecar alone.
"""
from __future__ import annotations

import json
import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvhold.protocol.state_files import MAX_GENERATION, StateFileError, integer

_INSTANCE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$")
SHM_PREFIX = "kvhold"
HOLD_FILE = "pool-restart.hold"
# the unix sockets in an instance's runtime directory, and the most bytes a socket's path may
# have (sun_path is 108 bytes with its terminating NUL)
SOCKET_NAMES = ("client.sock", "control.sock", "fd.sock", "frontend-link.sock", "zygote.sock")
MAX_SOCKET_PATH = 107
log = logging.getLogger(__name__)


def validate_instance(name: str) -> str:
    if not _INSTANCE_RE.match(name):
        raise ValueError(
            f"invalid instance name {name!r}: use 1-48 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit")
    return name


def http_routing_id(instance: str) -> bytes:
    """The ZeroMQ routing id of `kvhold serve`'s HTTP server in front of `instance`: one per
    instance, so that a restarted HTTP server is the same owner of its requests. A client ROUTER
    drops a second connection that presents a routing id in use, so only one HTTP server at a
    time can serve in front of a sidecar (the frontend's status names the transports on which
    it is connected: `client_peers.http_server`)."""
    return b"kvhold-serve-http." + instance.encode()


def default_runtime_root() -> Path:
    """$KVHOLD_RUNTIME_DIR, else $XDG_RUNTIME_DIR/kvhold, else /tmp/kvhold-<uid>."""
    env = os.environ.get("KVHOLD_RUNTIME_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "kvhold"
    return Path(f"/tmp/kvhold-{os.getuid()}")


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and parents we own) 0700; refuse one that others can enter."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to us ({os.getuid()})")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True, slots=True)
class InstancePaths:
    """All host-visible names of one instance."""

    instance: str
    runtime_dir: Path

    @classmethod
    def for_instance(cls, instance: str, runtime_root: Path | None = None) -> "InstancePaths":
        validate_instance(instance)
        root = runtime_root if runtime_root is not None else default_runtime_root()
        return cls(instance=instance, runtime_dir=Path(root) / instance)

    def socket_path_problem(self) -> str | None:
        """Why the instance's unix sockets cannot live in its runtime directory (a path too long
        to bind), or None."""
        longest = max((self.runtime_dir / name for name in SOCKET_NAMES), key=lambda p: len(os.fsencode(p)))
        size = len(os.fsencode(longest))
        if size <= MAX_SOCKET_PATH:
            return None
        return (f"the runtime directory {self.runtime_dir} is too deep for the instance's unix sockets: "
                f"{longest} has {size} bytes, a socket path at most {MAX_SOCKET_PATH}; use a shorter "
                f"--runtime-root (or $KVHOLD_RUNTIME_DIR) or instance name")

    def shm_name(self, what: str) -> str:
        return f"/{SHM_PREFIX}-{os.getuid()}-{self.instance}-{what}"

    @property
    def shm_prefix(self) -> str:
        return f"{SHM_PREFIX}-{os.getuid()}-{self.instance}-"

    @property
    def control_socket(self) -> Path:
        return self.runtime_dir / "control.sock"

    @property
    def client_socket(self) -> Path:
        return self.runtime_dir / "client.sock"

    @property
    def fd_socket(self) -> Path:
        return self.runtime_dir / "fd.sock"

    @property
    def token_file(self) -> Path:
        return self.runtime_dir / "token"

    @property
    def lock_file(self) -> Path:
        return self.runtime_dir / "lock"

    @property
    def state_file(self) -> Path:
        return self.runtime_dir / "sidecar.json"

    def spare_file(self, pid: int) -> Path:
        """Where a spare sidecar (`kvhold sidecar --spare`) says it waits: the holder it waits on."""
        return self.runtime_dir / f"spare-{pid}"

    def spare_pids(self) -> list[int]:
        """The spares that say they wait (their processes may have died since)."""
        return sorted(int(p.name[6:]) for p in self.runtime_dir.glob("spare-*") if p.name[6:].isdigit())

    @property
    def exit_file(self) -> Path:
        return self.runtime_dir / "sidecar-exit.json"

    def write_exit_reason(self, reason: str) -> None:
        """Why this process, a sidecar, is exiting with an error (`kvhold serve` reports it)."""
        if self.runtime_dir.is_dir():
            self.exit_file.write_text(json.dumps({"pid": os.getpid(), "reason": reason}) + "\n")

    def exit_reason(self, pid: int) -> str | None:
        """The reason the sidecar `pid` gave for its exit, if it gave one."""
        try:
            record = json.loads(self.exit_file.read_text())
        except (FileNotFoundError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("pid") != pid:
            return None
        return str(record.get("reason"))

    @property
    def control_endpoint(self) -> str:
        return f"ipc://{self.control_socket}"

    @property
    def client_endpoint(self) -> str:
        return f"ipc://{self.client_socket}"

    @property
    def hold_file(self) -> Path:
        return self.runtime_dir / HOLD_FILE

    @property
    def on_hold(self) -> bool:
        """A drained sidecar waits for the operator (`kvhold pool-restart --resume`)."""
        return self.hold_file.exists()

    def write_hold(self, record: dict) -> None:
        self.hold_file.write_text(json.dumps(record) + "\n")

    def release_hold(self) -> dict | None:
        """End the hold: the hold record ({} if unreadable), or None when there was none."""
        try:
            text = self.hold_file.read_text()
        except FileNotFoundError:
            return None
        self.hold_file.unlink(missing_ok=True)
        try:
            record = json.loads(text)
            if not isinstance(record, dict):
                raise StateFileError("not a map")
            integer(record.get("generation", 0), "generation", 0, MAX_GENERATION)
        except (ValueError, RecursionError) as exc:     # StateFileError is a ValueError
            log.error("the hold record %s was damaged (%s): released, its generation unknown",
                      self.hold_file, exc if isinstance(exc, StateFileError) else type(exc).__name__)
            return {}
        return record
