"""Binary layout of the shared tables segment (its version: LAYOUT_VERSION).

One POSIX shm segment per instance, little-endian, every section 64-byte aligned:

    offset          section        records
    0               header         1 x HEADER_DTYPE, padded to 4096 bytes
    off_leases      leases         num_leases x LEASE_DTYPE    (64 B)
    off_liveness    liveness       num_leases x 64 B: a robust pthread mutex per lease
                                   (kvhold.protocol.liveness), held by the lease's executor
    off_pages       page table     num_pages  x PAGE_DTYPE     (48 B)
    off_requests    journal meta   num_slots  x REQUEST_DTYPE  (256 B)
    off_tokens      journal tokens num_slots  x max_seq_len    int32
    off_page_lists  journal pages  num_slots  x max_pages_per_seq int32
    off_logprobs    journal logprobs num_slots x max_seq_len x logprob_dtype(max_logprobs):
                                   per token position, the log-probability of the token there,
                                   its rank and the max_logprobs most likely tokens (ids, log-probs)
                                   under the distribution that produced it; no bytes when
                                   max_logprobs is 0 (the area is off)
    off_extras      journal extras num_slots x max_extra_bytes: per request, the options of
                                   variable length (a structured-output grammar) as msgpack,
                                   `extra_len` bytes of it; none when max_extra_bytes is 0

Single writer per field. The sidecar writes the header, the lease fields other
than heartbeat/steps, and the admission half of each journal record (fields above
`exec_request_id`, plus the prompt part of its token row). The active executor
writes heartbeat/steps of its own lease, the page table, and the execution half of
the journal. Offsets are a pure function of the geometry: a reader recomputes them
and rejects a header that disagrees (see tables.Tables.attach).

Seqlock on pages: the writer makes `version` odd, updates (num_tokens, checksum,
owner, ...), then makes it even. A reader trusts a page only when the version is
even and unchanged across its read and the checksum of the committed bytes matches.
"""
from __future__ import annotations

import enum
import math
import zlib
from dataclasses import dataclass

import numpy as np

from kvhold.protocol.checksum import check_page_shape

MAGIC = b"KVHOLDT1"
LAYOUT_VERSION = 5           # 5: the extras area (options of variable length)
HEADER_BYTES = 4096
LIVENESS_BYTES = 64
ALIGN = 64

# Limits that bound what a reader will accept from an untrusted header.
MAX_LEASES = 64
MAX_PAGES = 1 << 24
MAX_SLOTS = 1 << 16
MAX_SEQ_LEN = 1 << 20
MAX_PAGE_TOKENS = 1024
MAX_TABLE_BYTES = 1 << 34
MAX_LOGPROBS = 1024          # top log-probs per position the logprob area can hold
MAX_EXTRA_BYTES = 1 << 24    # bytes per request the extras area can hold

KV_DTYPES = {1: "float32", 2: "bfloat16", 3: "float16", 4: "float64"}
KV_DTYPE_CODES = {v: k for k, v in KV_DTYPES.items()}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

HEADER_DTYPE = np.dtype([
    # immutable for the life of the segment: covered by geometry_crc
    ("magic", "S8"), ("layout_version", "<u4"), ("header_bytes", "<u4"),
    ("total_bytes", "<u8"), ("generation", "<u8"), ("created_unix_ns", "<u8"),
    ("sidecar_pid", "<i4"), ("num_leases", "<u4"),
    ("num_pages", "<u4"), ("num_slots", "<u4"), ("max_seq_len", "<u4"), ("page_tokens", "<u4"),
    ("num_layers", "<u4"), ("num_kv_heads", "<u4"), ("head_dim", "<u4"), ("kv_dtype", "<u4"),
    ("page_bytes", "<u8"),
    ("off_leases", "<u8"), ("off_liveness", "<u8"), ("off_pages", "<u8"), ("off_requests", "<u8"),
    ("off_tokens", "<u8"), ("off_page_lists", "<u8"),
    ("max_logprobs", "<u4"), ("off_logprobs", "<u8"),
    ("max_extra_bytes", "<u4"), ("off_extras", "<u8"),
    ("geometry_crc", "<u4"),
    # mutable, sidecar-written
    ("state", "<u4"), ("epoch_counter", "<u8"), ("request_counter", "<u8"),
    ("weights_state", "<u4"), ("weights_epoch", "<u4"), ("weights_fingerprint", "S32"),
    # the prefix cache's resets (POST /reset_prefix_cache): asked, counted by the frontend (its
    # one writer), and the last count the active executor carried out (its one writer); 0 in
    # tables of earlier builds
    ("prefix_reset_asked", "<u8"), ("prefix_reset_done", "<u8"),
])
_CRC_END = HEADER_DTYPE.fields["geometry_crc"][1]

LEASE_DTYPE = np.dtype([
    ("pid", "<i4"), ("role", "<u4"), ("epoch", "<u8"),
    ("heartbeat_ns", "<u8"), ("attached_ns", "<u8"), ("fenced_ns", "<u8"),
    ("steps", "<u8"),  # executor-written progress counter (flags and open_step, below, too)
    ("exit_code", "<i4"), ("flags", "<u4"),
    ("open_step", "<u8"),   # the number of the step the executor is running, 0 between steps
])

PAGE_DTYPE = np.dtype([
    ("version", "<u8"), ("owner", "<u8"), ("checksum", "<u8"), ("epoch", "<u8"),
    ("logical", "<u4"), ("num_tokens", "<u4"), ("flags", "<u4"), ("_pad", "<u4"),
])

MAX_STOP_IDS = 8
REQUEST_DTYPE = np.dtype([
    # admission half: sidecar-written; admit_state is written last (publication)
    ("request_id", "<u8"), ("owner_tag", "<u8"), ("seed", "<u8"), ("admitted_ns", "<u8"),
    ("admit_state", "<u4"), ("prompt_len", "<u4"), ("max_tokens", "<u4"), ("top_k", "<i4"),
    ("temperature", "<f4"), ("top_p", "<f4"), ("num_stop", "<u4"), ("flags", "<u4"),
    ("stop_ids", "<i4", (MAX_STOP_IDS,)),
    # generated tokens a resumed request brings (moved from another sidecar): they follow the
    # prompt in the token row and count as generated, so sampling positions stay absolute
    ("num_prefix", "<u4"),
    # log-probs asked for: 0 none, k + 1 with the k most likely tokens at each position, for the
    # generated tokens (logprobs) and for the prompt's (prompt_logprobs)
    ("logprobs", "<u2"), ("prompt_logprobs", "<u2"),
    # execution half: executor-written, valid only while exec_request_id == request_id;
    # num_generated is written after the token it counts (publication)
    ("exec_request_id", "<u8"), ("exec_epoch", "<u8"),
    ("first_token_ns", "<u8"), ("finished_ns", "<u8"),
    ("num_generated", "<u4"), ("exec_state", "<u4"), ("num_pages", "<u4"), ("finish_reason", "<u4"),
    ("num_preempted", "<u4"), ("num_recomputed", "<u4"),
    # the last step the request was in: the executor's epoch and step number (the lease's
    # open_step while it ran), and the KV positions that step computes, [step_start, step_end);
    # written before the step runs, so a death in the step names the requests in it
    ("step_epoch", "<u8"), ("step_seq", "<u8"), ("step_start", "<u4"), ("step_end", "<u4"),
    # when the request was first in a step (its first prefill chunk), 0 until then; reset by take
    ("scheduled_ns", "<u8"),
    # token positions [0, lp_done) whose log-probs are final in the logprob area (position 0 has
    # none): written after those log-probs, before the KV pages or the count they go with
    ("lp_done", "<u4"),
    # admission half (sidecar-written), where the record had padding: generated tokens before a
    # stop id or EOS may end the request; 0, what tables of earlier builds hold there, is none
    ("min_tokens", "<u4"),
    # execution half, where the record had padding: prompt tokens whose KV the request found in
    # the prefix cache when it started (kvhold.executor.prefix_cache); 0 in tables of earlier builds
    ("num_cached", "<u4"),
    # admission half, where the record had padding: vLLM's penalties and min_p (0 in tables of
    # earlier builds: no penalty, and a repetition penalty of 0 is read as 1, none)
    ("presence_penalty", "<f4"), ("frequency_penalty", "<f4"), ("repetition_penalty", "<f4"),
    ("min_p", "<f4"),
    # admission half: bytes of the request's record in the extras area (0: none)
    ("extra_len", "<u4"),
    ("_pad", "<u4", (8,)),
])

assert LEASE_DTYPE.itemsize == 64 and PAGE_DTYPE.itemsize == 48
assert REQUEST_DTYPE.itemsize == 256 and HEADER_DTYPE.itemsize <= HEADER_BYTES


class PoolState(enum.IntEnum):
    CREATING = 0
    READY = 1
    DRAINING = 2
    STOPPED = 3


class Role(enum.IntEnum):
    FREE = 0
    STARTING = 1   # spawned or attaching, not yet mapped
    STANDBY = 2    # mapped and warm, idle
    ACTIVE = 3     # owns the batch and the page table
    FENCED = 4     # epoch revoked; waiting for the process to exit


class LeaseFlag(enum.IntFlag):
    NONE = 0
    WARM = 1      # executor-written: its first active step is done; the normal lease applies


class PageFlag(enum.IntFlag):
    NONE = 0
    QUARANTINED = 1   # a fenced writer may still touch it; reuse after its exit
    BAD = 2           # failed validation
    CACHED = 4        # in the prefix cache: owner is its key, shared by the requests listing it


class AdmitState(enum.IntEnum):
    FREE = 0
    ADMITTED = 1
    CANCELLED = 2


class ExecState(enum.IntEnum):
    NONE = 0
    RUNNING = 1
    FINISHED = 2


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1
    LENGTH = 2
    CANCELLED = 3
    CONTEXT = 4
    ERROR = 5


class WeightsState(enum.IntEnum):
    EMPTY = 0
    LOADING = 1
    SEALED = 2


class RequestFlag(enum.IntFlag):
    NONE = 0
    IGNORE_EOS = 1


def logprob_dtype(max_logprobs: int) -> np.dtype:
    """One position of the logprob area: the log-probability of the token at that position, its
    rank there (1: the most likely; 1 + the tokens strictly more likely) and the `max_logprobs`
    most likely tokens there, most likely first (ties: lower id first)."""
    return np.dtype([("logprob", "<f4"), ("rank", "<i4"), ("top_ids", "<i4", (max_logprobs,)),
                     ("top_logprobs", "<f4", (max_logprobs,))])


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """Shape of one KV page: [layer][k/v][token][kv_head][head_dim]."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"
    page_tokens: int = 16

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            if not 1 <= getattr(self, name) <= (MAX_PAGE_TOKENS if name == "page_tokens" else 1 << 16):
                raise ValueError(f"KV geometry: {name}={getattr(self, name)} out of range")
        if self.dtype not in KV_DTYPE_CODES:
            raise ValueError(f"KV geometry: dtype {self.dtype!r} not one of {sorted(KV_DTYPE_CODES)}")
        try:
            check_page_shape(self.row_bytes, self.page_bytes)
        except ValueError as exc:
            raise ValueError(f"KV geometry: {exc}") from None

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """KV bytes of one token across all layers, keys and values."""
        return self.num_layers * 2 * self.row_bytes

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.token_bytes

    @property
    def page_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.page_tokens, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True, slots=True)
class TableGeometry:
    kv: KvGeometry
    num_pages: int
    num_slots: int = 256
    max_seq_len: int = 4096
    num_leases: int = 8
    max_logprobs: int = 0       # top log-probs per position; 0: no logprob area
    max_extra_bytes: int = 0    # bytes of variable-length options per request; 0: no extras area

    def __post_init__(self):
        limits = {"num_pages": MAX_PAGES, "num_slots": MAX_SLOTS,
                  "max_seq_len": MAX_SEQ_LEN, "num_leases": MAX_LEASES}
        for name, hi in limits.items():
            if not 1 <= getattr(self, name) <= hi:
                raise ValueError(f"table geometry: {name}={getattr(self, name)} not in 1..{hi}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"table geometry: max_logprobs={self.max_logprobs} not in 0..{MAX_LOGPROBS}")
        if not 0 <= self.max_extra_bytes <= MAX_EXTRA_BYTES:
            raise ValueError(f"table geometry: max_extra_bytes={self.max_extra_bytes} not in 0..{MAX_EXTRA_BYTES}")

    @property
    def logprob_bytes(self) -> int:
        """Bytes of the logprob area (0 when it is off)."""
        if not self.max_logprobs:
            return 0
        return self.num_slots * self.max_seq_len * logprob_dtype(self.max_logprobs).itemsize

    @property
    def max_pages_per_seq(self) -> int:
        return math.ceil(self.max_seq_len / self.kv.page_tokens)

    def offsets(self) -> dict[str, int]:
        off_leases = HEADER_BYTES
        off_liveness = _align(off_leases + self.num_leases * LEASE_DTYPE.itemsize)
        off_pages = _align(off_liveness + self.num_leases * LIVENESS_BYTES)
        off_requests = _align(off_pages + self.num_pages * PAGE_DTYPE.itemsize)
        off_tokens = _align(off_requests + self.num_slots * REQUEST_DTYPE.itemsize)
        off_page_lists = _align(off_tokens + self.num_slots * self.max_seq_len * 4)
        off_logprobs = _align(off_page_lists + self.num_slots * self.max_pages_per_seq * 4)
        off_extras = _align(off_logprobs + self.logprob_bytes)
        total = _align(off_extras + self.num_slots * self.max_extra_bytes)
        return {"off_leases": off_leases, "off_liveness": off_liveness, "off_pages": off_pages, "off_requests": off_requests,
                "off_tokens": off_tokens, "off_page_lists": off_page_lists, "off_logprobs": off_logprobs,
                "off_extras": off_extras, "total_bytes": total}

    @property
    def total_bytes(self) -> int:
        return self.offsets()["total_bytes"]

    @property
    def kv_pool_bytes(self) -> int:
        return self.num_pages * self.kv.page_bytes

    @property
    def metadata_fraction(self) -> float:
        """Table bytes as a fraction of the KV pool they describe."""
        return self.total_bytes / self.kv_pool_bytes


def header_crc(header: np.ndarray) -> int:
    return zlib.crc32(header.tobytes()[:_CRC_END])


def fill_header(header: np.ndarray, geometry: TableGeometry, generation: int,
                sidecar_pid: int, created_unix_ns: int) -> None:
    kv = geometry.kv
    header["magic"] = MAGIC
    header["layout_version"] = LAYOUT_VERSION
    header["header_bytes"] = HEADER_BYTES
    header["generation"] = generation
    header["created_unix_ns"] = created_unix_ns
    header["sidecar_pid"] = sidecar_pid
    header["num_leases"] = geometry.num_leases
    header["num_pages"] = geometry.num_pages
    header["num_slots"] = geometry.num_slots
    header["max_seq_len"] = geometry.max_seq_len
    header["page_tokens"] = kv.page_tokens
    header["num_layers"] = kv.num_layers
    header["num_kv_heads"] = kv.num_kv_heads
    header["head_dim"] = kv.head_dim
    header["kv_dtype"] = KV_DTYPE_CODES[kv.dtype]
    header["page_bytes"] = kv.page_bytes
    header["max_logprobs"] = geometry.max_logprobs
    header["max_extra_bytes"] = geometry.max_extra_bytes
    for key, value in geometry.offsets().items():
        header[key] = value
    header["geometry_crc"] = header_crc(header)


def geometry_from_header(header: np.ndarray) -> TableGeometry:
    """Rebuild and cross-check the geometry a header describes; ValueError if inconsistent."""
    code = int(header["kv_dtype"])
    if code not in KV_DTYPES:
        raise ValueError(f"unknown kv dtype code {code}")
    kv = KvGeometry(num_layers=int(header["num_layers"]), num_kv_heads=int(header["num_kv_heads"]),
                    head_dim=int(header["head_dim"]), dtype=KV_DTYPES[code],
                    page_tokens=int(header["page_tokens"]))
    geometry = TableGeometry(kv=kv, num_pages=int(header["num_pages"]),
                             num_slots=int(header["num_slots"]),
                             max_seq_len=int(header["max_seq_len"]),
                             num_leases=int(header["num_leases"]),
                             max_logprobs=int(header["max_logprobs"]),
                             max_extra_bytes=int(header["max_extra_bytes"]))
    if int(header["page_bytes"]) != kv.page_bytes:
        raise ValueError("page_bytes disagrees with the KV geometry")
    for key, value in geometry.offsets().items():
        if int(header[key]) != value:
            raise ValueError(f"{key}={int(header[key])} disagrees with the geometry ({value})")
    return geometry
