"""The sidecar's entry in the etcd registry (`--registry etcd://HOST:PORT --service NAME`).

`Registrar` keeps one key, `/kvhold/<service>/sidecars/<node>-<instance>`, alive under an
etcd lease of `ttl_s` from a daemon thread: it grants the lease, writes the entry (schema:
kvhold.routing.registry_client.SidecarEntry), refreshes the lease every ttl/3 and rewrites the entry
when health, endpoints or generation change (at once) or the load changes (at most once per
`load_interval_s`). It posts nothing to the sidecar's loop: it only calls `snapshot()`, which
reads a few counters. When etcd is unreachable it logs (first failure, then at most every
30 s) and retries with capped backoff; it never blocks or stops the sidecar. A lease that
etcd no longer knows (expired while unreachable) is replaced and the entry written again.
`stop()` revokes the lease so the entry vanishes at once on a clean shutdown; a killed
sidecar's entry vanishes when the lease expires. The entry is read from a
`SnapshotSource` (the few parts of a sidecar it is made of), never from the sidecar.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

from etcd3gw import exceptions as etcd_errors

from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import WeightsState
from kvhold.protocol.naming import InstancePaths
from kvhold.protocol.tables import Tables
from kvhold.sidecar.config import RegistryConfig
from kvhold.sidecar.weights_keeper import WeightsKeeper
from kvhold.protocol.page_table import PageTable
from kvhold.routing.registry_client import (EtcdGateway, RegistryUnavailable, SidecarEntry, node_name,
                                 service_prefix)


class TcpStatus(Protocol):
    """The client TCP endpoint as the registry reads it (kvhold.frontend.tcp_endpoint)."""

    def status(self) -> dict: ...

log = logging.getLogger(__name__)
LOG_EVERY_S = 30.0


class Registrar:
    def __init__(self, gateway: EtcdGateway, key: str, snapshot, ttl_s: int = 5,
                 load_interval_s: float = 1.0, poll_s: float = 0.2):
        self.gateway = gateway
        self.key = key
        self.snapshot = snapshot          # () -> SidecarEntry, cheap, callable from any thread
        self.ttl_s = ttl_s
        self.load_interval_s = load_interval_s
        self.poll_s = poll_s
        self.lease_id: int | None = None
        self.registered = False
        self.num_registrations = 0
        self.last_error = ""
        self._written: SidecarEntry | None = None
        self._written_at = 0.0
        self._refreshed_at = 0.0
        self._down_since: float | None = None
        self._logged_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvhold-registrar", daemon=True)

    def start(self) -> "Registrar":
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and revoke the lease (best effort, bounded by the etcd timeout)."""
        self._stop.set()
        self._thread.join(timeout)
        if self.lease_id is not None:
            try:
                self.gateway.revoke(self.lease_id)
            except (RegistryUnavailable, etcd_errors.Etcd3Exception):
                pass
            self.lease_id = None

    def status(self) -> dict:
        return {"key": self.key, "registered": self.registered, "lease_id": self.lease_id,
                "ttl_s": self.ttl_s, "registrations": self.num_registrations,
                "last_error": self.last_error}

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        backoff = 0.2
        while not self._stop.is_set():
            try:
                self._tick(time.monotonic())
                self._recovered()
                backoff = 0.2
                self._stop.wait(self.poll_s)
            except RegistryUnavailable as exc:
                self._failed(str(exc))
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            except etcd_errors.Etcd3Exception as exc:   # e.g. "requested lease not found"
                self._failed(f"etcd refused: {exc}")
                self.lease_id = None
                self._stop.wait(backoff)
            except Exception:   # a bug here must never reach the sidecar
                log.exception("registrar error; retrying")
                self._stop.wait(2.0)

    def _tick(self, now: float) -> None:
        entry = self.snapshot()
        if self.lease_id is None:
            self.lease_id = self.gateway.grant(self.ttl_s)
            self._put(entry, now)
            self._refreshed_at = now
            self.num_registrations += 1
            log.info("registered %s (lease %x, ttl %d s, health %s)", self.key, self.lease_id,
                     self.ttl_s, entry.health)
            return
        if now - self._refreshed_at >= self.ttl_s / 3:
            if self.gateway.refresh(self.lease_id) <= 0:
                log.warning("registry lease %x expired: registering again", self.lease_id)
                self.lease_id = None
                self.registered = False
                return
            self._refreshed_at = now
        if self._needs_write(entry, now):
            self._put(entry, now)

    def _needs_write(self, entry: SidecarEntry, now: float) -> bool:
        old = self._written
        if old is None:
            return True
        same = replace(old, in_flight=entry.in_flight, free_pages=entry.free_pages,
                       free_slots=entry.free_slots, updated=entry.updated)
        if same != entry:
            return True          # health, endpoints, generation, model: publish at once
        load_changed = (old.in_flight, old.free_pages, old.free_slots) != (
            entry.in_flight, entry.free_pages, entry.free_slots)
        return load_changed and now - self._written_at >= self.load_interval_s

    def _put(self, entry: SidecarEntry, now: float) -> None:
        self.gateway.put(self.key, entry.to_json(), self.lease_id)
        self._written, self._written_at = entry, now
        self.registered = True

    def _failed(self, message: str) -> None:
        now = time.monotonic()
        self.last_error = message
        if self._down_since is None:
            self._down_since = now
            self._logged_at = now
            log.warning("registry: %s; the sidecar keeps serving, retrying", message)
        elif now - self._logged_at >= LOG_EVERY_S:
            self._logged_at = now
            log.warning("registry still unreachable after %.0f s: %s", now - self._down_since, message)

    def _recovered(self) -> None:
        if self._down_since is not None:
            log.info("registry reachable again after %.1f s; entry %s", time.monotonic() - self._down_since,
                     "registered" if self.registered else "pending")
            self._down_since = None
            self.last_error = ""


# ---------------------------------------------------------------------- the sidecar's side
def gpu_uuid(device: str) -> str:
    """The GPU's UUID through NVML (no CUDA context), "cpu" on CPU, the device string if NVML
    is missing. NVML indices follow PCI order, CUDA's may not: set CUDA_DEVICE_ORDER=PCI_BUS_ID."""
    if not device.startswith("cuda"):
        return "cpu"
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(device.partition(":")[2] or 0))
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception:
        return device


@dataclass(frozen=True, slots=True)
class SnapshotSource:
    """What a registry entry is made of; every read is safe off the loop thread."""

    paths: InstancePaths
    model: Path | None                    # the checkpoint directory
    tables: Tables
    weights: WeightsKeeper
    tcp: TcpStatus | None
    admissions_closed: Callable[[], bool]
    active_ready: Callable[[], bool]      # an active executor is attached and ready
    in_flight: Callable[[], int]


def _health(src: SnapshotSource) -> str:
    if src.admissions_closed():
        return "drain"
    if src.weights.state != WeightsState.SEALED:
        return "starting"
    return "ok" if src.active_ready() else "recovering"


def _tcp_endpoint(src: SnapshotSource) -> tuple[str | None, str | None]:
    if src.tcp is None:
        return None, None
    status = src.tcp.status()
    host, _, port = status["endpoint"][len("tcp://"):].rpartition(":")
    if host in ("0.0.0.0", "[::]", "*"):     # a wildcard bind: name the node instead
        host = socket.getfqdn()
    return f"tcp://{host}:{port}", status.get("public_key")


def sidecar_snapshot(src: SnapshotSource, node: str, gpu: str) -> SidecarEntry:
    """The registry entry of a running sidecar, from reads that are safe off the loop thread."""
    free_slots = Journal(src.tables).num_free_slots()
    tcp, public_key = _tcp_endpoint(src)
    model = os.path.basename(os.path.normpath(str(src.model))) if src.model else ""
    pages = PageTable(src.tables).counts()
    return SidecarEntry(
        key="", node=node, instance=src.paths.instance, pid=os.getpid(), gpu=gpu, model=model,
        fingerprint=src.weights.fingerprint or "", generation=int(src.tables.generation),
        health=_health(src), in_flight=src.in_flight(),
        free_pages=pages["free"] + pages["cached"], free_slots=free_slots,   # idle cached pages: room
        endpoint=src.paths.client_endpoint, tcp_endpoint=tcp, curve_public_key=public_key,
        updated=round(time.time(), 3))


def start_registrar(config: RegistryConfig, device: str, src: SnapshotSource) -> Registrar | None:
    """Start registering a started sidecar when `config` names a registry."""
    if not config.url:
        return None
    node = node_name()
    key = f"{service_prefix(config.service)}{node}-{src.paths.instance}"
    gpu = gpu_uuid(device)
    gateway = EtcdGateway.from_url(config.url, timeout=min(2.0, config.ttl_s / 2))
    return Registrar(gateway, key, lambda: replace(sidecar_snapshot(src, node, gpu), key=key),
                     ttl_s=config.ttl_s).start()
