"""The shared tables segment: creation by the sidecar, attachment by everyone else.

`Tables` wraps a buffer laid out as described in `kvhold.protocol.layout` and exposes numpy
views of each section (no copies: writes land in shared memory). Only the sidecar
creates the POSIX shm object (0600, named per instance) and only it unlinks it.
`Tables.attach` validates an untrusted buffer completely before exposing any view:
magic, layout version, header CRC, and that every offset is the one the geometry
implies and fits the buffer. Anything else raises `TableFormatError`.
"""
from __future__ import annotations

import mmap
import os
import time

import numpy as np
import posix_ipc

from kvhold.protocol.memory import back_shm
from kvhold.protocol.layout import (HEADER_BYTES, HEADER_DTYPE, LAYOUT_VERSION, LEASE_DTYPE, LIVENESS_BYTES, MAGIC, logprob_dtype,
                        MAX_TABLE_BYTES, PAGE_DTYPE, REQUEST_DTYPE, PoolState, TableGeometry,
                        WeightsState, fill_header, geometry_from_header, header_crc)


class TableFormatError(ValueError):
    """The buffer is not a kvhold tables segment this code can read."""


class Tables:
    """Numpy views over one tables segment."""

    def __init__(self, buf, geometry: TableGeometry, *, shm=None, mm=None):
        self.geometry = geometry
        self._buf = buf
        self._shm = shm
        self._mm = mm
        self._mutexes: dict = {}
        g, off = geometry, geometry.offsets()
        self.header = np.ndarray((), HEADER_DTYPE, buffer=buf, offset=0)
        self.leases = np.ndarray((g.num_leases,), LEASE_DTYPE, buffer=buf, offset=off["off_leases"])
        self.pages = np.ndarray((g.num_pages,), PAGE_DTYPE, buffer=buf, offset=off["off_pages"])
        self.requests = np.ndarray((g.num_slots,), REQUEST_DTYPE, buffer=buf,
                                   offset=off["off_requests"])
        self.tokens = np.ndarray((g.num_slots, g.max_seq_len), "<i4", buffer=buf,
                                 offset=off["off_tokens"])
        self.page_lists = np.ndarray((g.num_slots, g.max_pages_per_seq), "<i4", buffer=buf,
                                     offset=off["off_page_lists"])
        # per token position: its log-prob and the top ones (None when the area is off)
        self.logprobs = (np.ndarray((g.num_slots, g.max_seq_len), logprob_dtype(g.max_logprobs), buffer=buf,
                                    offset=off["off_logprobs"]) if g.max_logprobs else None)
        # per slot: its request's variable-length options (None when the area is off)
        self.extras = (np.ndarray((g.num_slots, g.max_extra_bytes), "u1", buffer=buf, offset=off["off_extras"])
                       if g.max_extra_bytes else None)

    # ------------------------------------------------------------------ creation
    @classmethod
    def create(cls, shm_name: str, geometry: TableGeometry, generation: int) -> "Tables":
        """Create the segment (owner-only) and write a fresh header. Sidecar only."""
        size = geometry.total_bytes
        shm = posix_ipc.SharedMemory(shm_name, flags=posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            os.fchmod(shm.fd, 0o600)
            back_shm(shm.fd, size, "tables")
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            raise
        tables = cls(mm, geometry, shm=shm, mm=mm)
        tables.pages["owner"] = 0
        tables.page_lists[:] = -1
        fill_header(tables.header, geometry, generation, os.getpid(), time.time_ns())
        tables.header["state"] = PoolState.READY
        return tables

    @classmethod
    def adopt(cls, shm_name: str) -> "Tables":
        """Open a predecessor's segment by name, validated as `attach` does, keeping its shm
        object as `create` does (kvhold.sidecar.adoption: a restarted sidecar takes it over).
        The caller checks geometry and generation, then `claim`s it. Sidecar only."""
        shm = posix_ipc.SharedMemory(shm_name)
        try:
            size = os.fstat(shm.fd).st_size
            mm = mmap.mmap(shm.fd, size)
        except BaseException:
            shm.close_fd()
            raise
        try:
            found = cls.attach(mm)
        except BaseException:
            mm.close()
            shm.close_fd()
            raise
        return cls(mm, found.geometry, shm=shm, mm=mm)

    def claim(self, sidecar_pid: int) -> None:
        """Write the adopting sidecar's pid into the header (the CRC covers it): executors that
        wait for a sidecar take it as the sign to attach again."""
        self.header["sidecar_pid"] = sidecar_pid
        self.header["geometry_crc"] = header_crc(self.header)

    @classmethod
    def attach(cls, buf) -> "Tables":
        """Validate an untrusted buffer and return views over it."""
        size = len(buf)
        if size < HEADER_BYTES:
            raise TableFormatError(f"segment of {size} bytes is smaller than a header")
        header = np.ndarray((), HEADER_DTYPE, buffer=buf, offset=0)
        if bytes(header["magic"]) != MAGIC:
            raise TableFormatError("bad magic: not a kvhold tables segment")
        if int(header["layout_version"]) != LAYOUT_VERSION:
            raise TableFormatError(f"layout version {int(header['layout_version'])}, "
                                   f"this build reads {LAYOUT_VERSION}")
        if int(header["header_bytes"]) != HEADER_BYTES:
            raise TableFormatError("unexpected header size")
        if int(header["geometry_crc"]) != header_crc(header):
            raise TableFormatError("header CRC mismatch (torn or corrupted header)")
        try:
            geometry = geometry_from_header(header)
        except ValueError as exc:
            raise TableFormatError(f"inconsistent geometry: {exc}") from None
        total = geometry.total_bytes
        if total != int(header["total_bytes"]) or total > size or total > MAX_TABLE_BYTES:
            raise TableFormatError(f"segment is {size} bytes, header says {int(header['total_bytes'])}")
        return cls(buf, geometry)

    @classmethod
    def attach_fd(cls, fd: int) -> "Tables":
        """Map a segment received as a file descriptor (executors, inspectors)."""
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
        try:
            tables = cls.attach(mm)
        except BaseException:
            mm.close()
            raise
        tables._mm = mm
        return tables

    @classmethod
    def attach_name(cls, shm_name: str) -> "Tables":
        shm = posix_ipc.SharedMemory(shm_name)
        try:
            return cls.attach_fd(shm.fd)
        finally:
            shm.close_fd()

    # ------------------------------------------------------------------ identity
    @property
    def fd(self) -> int:
        if self._shm is None:
            raise RuntimeError("only the creating sidecar holds the segment's fd")
        return self._shm.fd

    @property
    def generation(self) -> int:
        return int(self.header["generation"])

    @property
    def state(self) -> PoolState:
        """The pool's state (PoolState: whether it is ready to serve)."""
        return PoolState(int(self.header["state"]))

    @property
    def sidecar_pid(self) -> int:
        """The pid of the sidecar that created the segment."""
        return int(self.header["sidecar_pid"])

    @property
    def weights_state(self) -> WeightsState:
        return WeightsState(int(self.header["weights_state"]))

    @property
    def weights_epoch(self) -> int:
        """The epoch of the executor designated to load the weights (while LOADING)."""
        return int(self.header["weights_epoch"])

    @property
    def weights_fingerprint(self) -> str:
        """The fingerprint the weights were sealed with, as hex (meaningful once SEALED)."""
        return bytes(self.header["weights_fingerprint"]).ljust(32, b"\0").hex()  # numpy strips NULs

    def next_epoch(self) -> int:
        """A new globally increasing epoch (sidecar only)."""
        self.header["epoch_counter"] += 1
        return int(self.header["epoch_counter"])

    def liveness_mutex(self, slot: int):
        """The robust mutex of lease `slot` (see kvhold.protocol.liveness)."""
        from kvhold.protocol.liveness import RobustMutex

        if not 0 <= slot < self.geometry.num_leases:
            raise IndexError(f"lease slot {slot} out of range")
        if slot not in self._mutexes:
            offset = self.geometry.offsets()["off_liveness"] + slot * LIVENESS_BYTES
            self._mutexes[slot] = RobustMutex(self._buf, offset)
        return self._mutexes[slot]

    def close(self) -> None:
        """Drop every view and the mapping. The object is unusable afterwards."""
        for name in ("header", "leases", "pages", "requests", "tokens", "page_lists"):
            setattr(self, name, None)
        self._mutexes.clear()
        self._buf = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the process
            self._mm = None

    def unlink(self) -> None:
        """Close and remove the shm object (creator only)."""
        shm, self._shm = self._shm, None
        self.close()
        if shm is not None:
            shm.close_fd()
            try:
                shm.unlink()
            except posix_ipc.ExistentialError:
                pass
