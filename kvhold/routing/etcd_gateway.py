"""etcd access for the registry: etcd's v3 JSON gateway through etcd3gw, over several endpoints.

Client library: etcd3gw, OpenStack's client for etcd's v3 JSON gateway. It is plain HTTP
over `requests` (no gRPC/protobuf stack to build or pin), speaks to Debian's etcd 3.4 and
later, and handles base64 keys and leases. Its watch helper hides stream failures (a watch
silently ends when etcd restarts), so `EtcdGateway.watch` streams the gateway's /v3/watch
itself on etcd3gw's HTTP session and simply ends on any failure or quiet spell: the caller
(kvhold.routing.registry_client.RegistryView) lists again. Every call fails over across the given
endpoints and raises `RegistryUnavailable` when none answers; nothing here retries forever.
"""
from __future__ import annotations

import base64
import json

import etcd3gw
import requests
from etcd3gw import exceptions as etcd_errors


class RegistryUnavailable(Exception):
    """No etcd endpoint answered."""


def parse_registry_url(url: str) -> list[tuple[str, int]]:
    """etcd://HOST:PORT[,HOST:PORT...] -> [(host, port), ...]; ValueError otherwise."""
    usage = f"--registry wants etcd://HOST:PORT[,HOST:PORT], got {url!r}"
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ValueError(usage)
    out = []
    for part in url[len("etcd://"):].split(","):
        host, sep, port = part.strip().rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(usage)
        out.append((host, int(port)))
    return out


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _prefix_end(prefix: str) -> str:
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class EtcdGateway:
    """Calls to etcd's v3 JSON gateway through etcd3gw; fails over across the given endpoints
    and raises RegistryUnavailable when none answers. Needs etcd >= 3.4 (the /v3 path)."""

    def __init__(self, endpoints: list[tuple[str, int]], timeout: float = 2.0):
        self.timeout = timeout
        self._clients = [etcd3gw.Etcd3Client(host=h, port=p, timeout=timeout, api_path="/v3/")
                         for h, p in endpoints]
        self._current = 0

    @classmethod
    def from_url(cls, url: str, timeout: float = 2.0) -> "EtcdGateway":
        return cls(parse_registry_url(url), timeout)

    def _call(self, fn):
        errors = []
        for i in range(len(self._clients)):
            index = (self._current + i) % len(self._clients)
            try:
                result = fn(self._clients[index])
            except (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
                    requests.RequestException) as exc:
                errors.append(f"{self._clients[index].base_url}: {type(exc).__name__}")
                continue
            self._current = index
            return result
        raise RegistryUnavailable("etcd unreachable (" + "; ".join(errors) + ")")

    def grant(self, ttl: int) -> int:
        return self._call(lambda c: int(c.lease(ttl).id))

    def refresh(self, lease_id: int) -> int:
        """Remaining TTL, or -1 when etcd no longer knows the lease."""
        return self._call(lambda c: etcd3gw.Lease(lease_id, c).refresh())

    def revoke(self, lease_id: int) -> None:
        self._call(lambda c: etcd3gw.Lease(lease_id, c).revoke())

    def put(self, key: str, value: str, lease_id: int | None = None) -> None:
        self._call(lambda c: c.put(key, value, lease=etcd3gw.Lease(lease_id, c) if lease_id else None))

    def delete(self, key: str) -> None:
        self._call(lambda c: c.delete(key))

    def list(self, prefix: str) -> tuple[list[tuple[str, bytes, int]], int]:
        """([(key, value, mod_revision)], store revision) for every key under `prefix`."""
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}
        reply = self._call(lambda c: c.post(c.get_url("/kv/range"), json=body))
        kvs = [(base64.b64decode(kv["key"]).decode(errors="replace"),
                base64.b64decode(kv.get("value", "")), int(kv.get("mod_revision", 0)))
               for kv in reply.get("kvs", [])]
        return kvs, int(reply["header"]["revision"])

    def watch(self, prefix: str, start_revision: int, quiet_s: float):
        """Yield (kind, key, value, mod_revision) events, kind "PUT" or "DELETE", until the
        stream ends, fails, or stays quiet for `quiet_s` (the caller then lists again)."""
        client = self._clients[self._current]
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                                   "start_revision": start_revision}}
        try:
            with client.session.post(client.get_url("/watch"), json=body, stream=True,
                                     timeout=(self.timeout, quiet_s)) as resp:
                if resp.status_code != 200:
                    return
                for line in resp.iter_lines():
                    result = json.loads(line).get("result", {}) if line.strip() else {}
                    if result.get("canceled") or result.get("compact_revision"):
                        return
                    for ev in result.get("events", ()):
                        kv = ev.get("kv", {})
                        key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
                        yield (ev.get("type", "PUT"), key, base64.b64decode(kv.get("value", "")),
                               int(kv.get("mod_revision", 0)))
        except (requests.RequestException, ValueError, AttributeError):
            return
