"""The descriptor hand-back: an executor gives its regions' descriptors back to a restarted sidecar.

A sidecar killed outright takes its ends of the memory with it, but not the memory: each
executor maps the regions, and keeps open a duplicate of every region descriptor it received
(kvhold.executor.runtime). Host regions have names a new sidecar can open; CUDA VMM memory
has none, and an imported allocation handle cannot be exported again
(cuMemExportToShareableHandle refuses it with CUDA_ERROR_INVALID_VALUE). A received POSIX-fd
handle is itself the shareable handle, though: passed on over SCM_RIGHTS, another process
imports it and maps the same memory. So an executor that waits for a new sidecar hands its
kept descriptors back (`HandBack`, one datagram on the descriptor socket, kvhold.protocol.fdpass)
before it attaches again, and the new sidecar builds its regions from them
(kvhold.sidecar.hand_back).

The request is authenticated as Attach is: the instance's executor token, the pid checked
against the peer's SO_PEERCRED, and the lease (slot, epoch) the executor holds. Each region
travels with the RegionInfo the executor was given, so the sidecar can compare it with the
geometry it computes before it trusts any descriptor.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvhold.protocol.memory import RegionInfo

TYPE = "hand_back"
MAX_REGIONS = 8


class HandBackFormatError(ValueError):
    """A hand-back datagram that is not a well-formed HandBack."""


@dataclass(frozen=True, slots=True)
class HandBack:
    token: str
    pid: int
    slot: int
    epoch: int
    regions: tuple[RegionInfo, ...]     # in the order of the descriptors

    def to_wire(self) -> dict:
        return {"type": TYPE, "token": self.token, "pid": self.pid, "slot": self.slot,
                "epoch": self.epoch, "regions": [r.to_wire() for r in self.regions]}

    @classmethod
    def from_wire(cls, d: dict) -> "HandBack":
        if d.get("type") != TYPE:
            raise HandBackFormatError(f"not a {TYPE} request")
        for key, kind in (("token", str), ("pid", int), ("slot", int), ("epoch", int), ("regions", list)):
            if not isinstance(d.get(key), kind) or isinstance(d.get(key), bool):
                raise HandBackFormatError(f"{TYPE}: field {key!r} must be {kind.__name__}")
        if not 0 < len(d["regions"]) <= MAX_REGIONS:
            raise HandBackFormatError(f"{TYPE}: 1..{MAX_REGIONS} regions, got {len(d['regions'])}")
        try:
            regions = tuple(RegionInfo.from_wire(r) for r in d["regions"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise HandBackFormatError(f"{TYPE}: bad region: {exc}") from None
        if len({r.name for r in regions}) != len(regions):
            raise HandBackFormatError(f"{TYPE}: a region is named twice")
        return cls(token=d["token"], pid=d["pid"], slot=d["slot"], epoch=d["epoch"], regions=regions)


def is_hand_back(d: dict) -> bool:
    return isinstance(d, dict) and d.get("type") == TYPE
