"""The sidecar registry in etcd as clients see it: entry schema, watching, picking.

Layout: one key per sidecar, `/kvhold/<service>/sidecars/<node>-<instance>`, holding a JSON
object (schema 1, see `SidecarEntry`) written by `kvhold.sidecar.registry` under an etcd lease: a
sidecar that dies stops refreshing the lease and its key disappears after the TTL. Readers
trust nothing: an entry that is not JSON, has the wrong schema or a bad field is ignored
with one log line (per key and revision), never raised to the caller.

`RegistryView` keeps a live copy: list, watch from the listed revision, and list again
whenever the watch ends or stays quiet for `resync_s`. While etcd is unreachable a view
keeps its last snapshot: an etcd outage must not take the service down. etcd access (and
why etcd3gw) is in kvhold.routing.etcd_gateway.
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import asdict, dataclass

from kvhold.routing.etcd_gateway import EtcdGateway, RegistryUnavailable, parse_registry_url

__all__ = ["SidecarEntry", "RegistryView", "EtcdGateway", "RegistryUnavailable", "parse_registry_url",
           "pick_sidecar", "parse_entry", "list_entries", "service_prefix", "node_name"]

log = logging.getLogger(__name__)
SCHEMA = 1
HEALTH = ("ok", "recovering", "starting", "drain")   # ok/recovering serve; the rest are avoided
SERVING_RANK = {"ok": 0, "recovering": 1}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_MAX_VALUE = 64 << 10


def validate_service(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"--service must be 1-128 of [A-Za-z0-9_.-], got {name!r}")
    return name


def node_name() -> str:
    """This machine's name in the registry: env KVHOLD_NODE, else the host name."""
    return os.environ.get("KVHOLD_NODE") or socket.gethostname()


def service_prefix(service: str) -> str:
    return f"/kvhold/{validate_service(service)}/sidecars/"


# ---------------------------------------------------------------------- entries
_FIELDS = {  # wire path -> (attribute, type); every field is required
    ("node",): ("node", str), ("instance",): ("instance", str), ("pid",): ("pid", int),
    ("gpu",): ("gpu", str), ("model", "name"): ("model", str),
    ("model", "fingerprint"): ("fingerprint", str), ("generation",): ("generation", int),
    ("health",): ("health", str), ("load", "in_flight"): ("in_flight", int),
    ("load", "free_pages"): ("free_pages", int), ("load", "free_slots"): ("free_slots", int),
    ("endpoints", "ipc"): ("endpoint", str), ("endpoints", "tcp"): ("tcp_endpoint", (str, type(None))),
    ("endpoints", "curve_public_key"): ("curve_public_key", (str, type(None))),
    ("updated",): ("updated", (int, float)),
}


@dataclass(frozen=True, slots=True)
class SidecarEntry:
    key: str
    node: str
    instance: str
    pid: int
    gpu: str                      # GPU UUID, or "cpu"
    model: str                    # model name (the checkpoint directory's name)
    fingerprint: str              # sealed weights' layout fingerprint ("" until sealed)
    generation: int               # pool generation
    health: str                   # one of HEALTH
    in_flight: int
    free_pages: int
    free_slots: int
    endpoint: str                 # ipc://... (same node only)
    tcp_endpoint: str | None      # tcp://HOST:PORT when the sidecar serves TCP
    curve_public_key: str | None  # z85, when the TCP endpoint speaks CurveZMQ
    updated: float                # unix seconds of the write

    @property
    def serving(self) -> bool:
        return self.health in SERVING_RANK

    def to_json(self) -> str:
        d = asdict(self)
        doc: dict = {"schema": SCHEMA}
        for path, (attr, _) in _FIELDS.items():
            node = doc
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = d[attr]
        return json.dumps(doc, sort_keys=True)

    @classmethod
    def from_json(cls, key: str, raw: bytes | str) -> "SidecarEntry":
        """Parse and validate one value; ValueError names the first defect."""
        if len(raw) > _MAX_VALUE:
            raise ValueError(f"value of {len(raw)} bytes is over {_MAX_VALUE}")
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError(f"not a schema {SCHEMA} object")
        values = {"key": key}
        for path, (attr, tp) in _FIELDS.items():
            v = doc
            for part in path:
                v = v.get(part, KeyError) if isinstance(v, dict) else KeyError
            if v is KeyError or isinstance(v, bool) or not isinstance(v, tp):
                raise ValueError(f"field {'.'.join(path)} is missing or not {tp}")
            values[attr] = v
        if values["health"] not in HEALTH:
            raise ValueError(f"health {values['health']!r} is not one of {HEALTH}")
        if min(values["pid"], values["generation"], values["in_flight"], values["free_pages"],
               values["free_slots"]) < 0:
            raise ValueError("negative count")
        if not values["endpoint"].startswith("ipc://") or not (
                values["tcp_endpoint"] is None or values["tcp_endpoint"].startswith("tcp://")):
            raise ValueError("endpoints must be ipc://... and tcp://...")
        return cls(**values)

    def describe(self) -> str:
        tcp = f" {self.tcp_endpoint}" if self.tcp_endpoint else ""
        return (f"{self.key.rsplit('/', 1)[-1]:<28} {self.health:<10} gen {self.generation:<3} "
                f"in_flight {self.in_flight:<4} free_pages {self.free_pages:<6} {self.gpu} "
                f"{self.model} pid {self.pid} {self.endpoint}{tcp}")


def pick_sidecar(entries, *, exclude=(), fingerprint: str | None = None, local_node: str | None = None,
                 pending: dict | None = None, used: dict | None = None) -> SidecarEntry | None:
    """The least loaded serving sidecar: health ok before recovering, then fewest requests in
    flight (plus `pending`, the caller's own recent submissions), then least `used` by the
    caller so far (round robin among equals), then most free pages. Skips
    `exclude` keys, other weights when `fingerprint` is given, and sidecars this node can't
    reach (ipc:// only on `local_node`, else a TCP endpoint is needed)."""
    pending, used = pending or {}, used or {}
    ok = [e for e in entries if e.serving and e.key not in exclude
          and (fingerprint is None or e.fingerprint == fingerprint)
          and (e.node == local_node or e.tcp_endpoint)]
    if not ok:
        return None
    return min(ok, key=lambda e: (SERVING_RANK[e.health], e.in_flight + pending.get(e.key, 0),
                                  used.get(e.key, 0), -e.free_pages, e.key))


def parse_entry(prefix: str, key: str, value: bytes | str) -> SidecarEntry:
    """A validated entry for `key` under `prefix`; ValueError names the first defect."""
    if not key.startswith(prefix) or not _NAME.match(key[len(prefix):]):
        raise ValueError("key is not <prefix><node>-<instance>")
    return SidecarEntry.from_json(key, value)


def list_entries(registry_url: str, service: str) -> tuple[list[SidecarEntry], list[str]]:
    """One listing, for `kvhold registry list`: (valid entries, "key: defect" for the rest)."""
    prefix = service_prefix(service)
    kvs, _ = EtcdGateway.from_url(registry_url).list(prefix)
    good, bad = [], []
    for key, value, _ in kvs:
        try:
            good.append(parse_entry(prefix, key, value))
        except ValueError as exc:
            bad.append(f"{key}: {exc}")
    return good, bad


# ---------------------------------------------------------------------- watching
class RegistryView:
    """A live, validated copy of one service's entries, kept by a daemon thread.

    `entries()` and `get()` are safe from any thread. `on_change(entries)` (optional) runs on
    the watcher thread after every change. `connected` is False while etcd is unreachable;
    the last snapshot is kept meanwhile."""

    def __init__(self, gateway: EtcdGateway, service: str, *, resync_s: float = 5.0, on_change=None):
        self.gateway = gateway
        self.prefix = service_prefix(service)
        self.resync_s = resync_s
        self.on_change = on_change
        self.connected = False
        self._entries: dict[str, SidecarEntry] = {}
        self._rejected: set[tuple[str, int]] = set()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, wait_s: float = 2.0) -> "RegistryView":
        """Start watching; waits up to `wait_s` for a first listing (not an error if none)."""
        self._thread = threading.Thread(target=self._run, name="kvhold-registry-view", daemon=True)
        self._thread.start()
        self.wait_until(lambda entries: self.connected, wait_s)
        return self

    def stop(self) -> None:
        self._stop.set()

    def entries(self) -> list[SidecarEntry]:
        with self._lock:
            return sorted(self._entries.values(), key=lambda e: e.key)

    def get(self, key: str) -> SidecarEntry | None:
        with self._lock:
            return self._entries.get(key)

    def wait_until(self, predicate, timeout: float) -> bool:
        """Wait until predicate(entries) holds; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate(sorted(self._entries.values(), key=lambda e: e.key)):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(min(left, 0.1))
        return True

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                kvs, revision = self.gateway.list(self.prefix)
            except Exception as exc:    # unreachable, or an error reply: keep what we have
                if self.connected or backoff == 0.1:
                    log.warning("registry view: %s; keeping the last %d entries", exc, len(self._entries))
                self._set_connected(False)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            backoff = 0.1
            self._replace({k: self._parse(k, v, rev) for k, v, rev in kvs})
            self._set_connected(True)
            for kind, key, value, rev in self.gateway.watch(self.prefix, revision + 1, self.resync_s):
                self._apply(kind, key, value, rev)
                if self._stop.is_set():
                    return

    def _parse(self, key: str, value: bytes, revision: int) -> SidecarEntry | None:
        try:
            return parse_entry(self.prefix, key, value)
        except ValueError as exc:
            if (key, revision) not in self._rejected:
                if len(self._rejected) > 10_000:     # bounded: a flood of junk may log twice
                    self._rejected.clear()
                self._rejected.add((key, revision))
                log.warning("ignored registry entry %s (revision %d): %s", key, revision, exc)
            return None

    def _replace(self, parsed: dict) -> None:
        with self._lock:
            self._entries = {k: e for k, e in parsed.items() if e is not None}
            self._lock.notify_all()
        self._changed()

    def _apply(self, kind: str, key: str, value: bytes, revision: int) -> None:
        entry = self._parse(key, value, revision) if kind == "PUT" else None
        with self._lock:
            if entry is None:
                self._entries.pop(key, None)
            else:
                self._entries[key] = entry
            self._lock.notify_all()
        self._changed()

    def _set_connected(self, value: bool) -> None:
        with self._lock:
            self.connected = value
            self._lock.notify_all()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change(self.entries())
            except Exception:   # a caller's bug must not stop the watch
                log.exception("registry on_change callback failed")
