"""Classifying pages after a crash: the rules recovery, tools and tests share.

A page record is classified from its seqlock version, its fields and whether the
checksum of its committed bytes matches (computed wherever the bytes live: numpy
here for host memory, torch on the device in kvhold.executor.recovery):

    FREE         no owner
    VALID        even version, sane fields, checksum matches
    INTERRUPTED  odd version: its writer died mid-update. Kept only if the
                 checksum matches (the pair (count, checksum) is then consistent);
                 a takeover keeps the rows of a publish's torn pair (new count, old
                 checksum) that the old checksum covers (`torn_prefixes`)
    CORRUPT      even version but the checksum does not match: bytes changed
                 after they were committed (bit flip, stray write)
    MALFORMED    fields out of range (count above page size)
"""
from __future__ import annotations

import enum

import numpy as np

from kvhold.protocol.checksum import words_checksum_np
from kvhold.protocol.journal import segment_positions
from kvhold.protocol.tables import Tables


class PageClass(enum.IntEnum):
    FREE = 0
    VALID = 1
    INTERRUPTED = 2
    CORRUPT = 3
    MALFORMED = 4


def classify(records: np.ndarray, page_tokens: int, checksum_ok: np.ndarray) -> np.ndarray:
    """Vectorised classification of page records given per-record checksum verdicts."""
    out = np.full(len(records), PageClass.VALID, dtype=np.int8)
    odd = (records["version"] & 1).astype(bool)
    malformed = records["num_tokens"] > page_tokens
    out[~checksum_ok] = PageClass.CORRUPT
    out[odd] = PageClass.INTERRUPTED
    out[malformed] = PageClass.MALFORMED
    out[records["owner"] == 0] = PageClass.FREE
    return out


def trusted(records: np.ndarray, page_tokens: int, checksum_ok: np.ndarray) -> np.ndarray:
    """Which records recovery may keep: valid, or interrupted with a matching checksum."""
    cls = classify(records, page_tokens, checksum_ok)
    return (cls == PageClass.VALID) | ((cls == PageClass.INTERRUPTED) & checksum_ok)


def torn_prefixes(idx: np.ndarray, recorded: np.ndarray, counts: np.ndarray, sum_ok: np.ndarray,
                  torn: np.ndarray, checksum_of) -> tuple[np.ndarray, np.ndarray]:
    """The rows committed before a publish that its writer's death interrupted.

    `PageTable.publish` writes a page's new count, then its new checksum: a death between the
    two leaves an odd version with the new count and the old checksum, which matches the rows
    committed before (committed rows are never written again). For each such record (`torn`:
    indices into `idx`, the checked pages, of odd versions whose fields are sane and whose
    checksum does not match their count), the longest shorter prefix whose checksum is the
    recorded one (`recorded`, per checked page) is trusted: its count replaces the record's,
    its verdict becomes a match. A record no prefix matches stays untrusted.
    `checksum_of(pages, counts)` gives the checksums (uint64) of those pages' first rows, in one
    pass wherever the bytes live. Returns (counts, sum_ok), copies."""
    counts, sum_ok = counts.copy(), sum_ok.copy()
    shorter = counts[torn]
    which = np.repeat(torn, shorter)             # each torn record, once per shorter prefix
    k = segment_positions(shorter)               # 0 .. count - 1, ascending
    match = checksum_of(idx[which], k) == recorded[which]
    for i, n in zip(which[match].tolist(), k[match].tolist()):
        counts[i] = n                            # ascending per record: the longest match wins
        sum_ok[i] = True
    return counts, sum_ok


def host_checksums_ok(tables: Tables, kv_words: np.ndarray) -> np.ndarray:
    """Per-page verdict for a KV pool in host memory (uint64 view [P, L, 2, T, W])."""
    pages = tables.pages
    index = np.arange(int(np.prod(kv_words.shape[1:])), dtype=np.uint64).reshape(kv_words.shape[1:])
    ok = np.ones(len(pages), dtype=bool)
    page_tokens = kv_words.shape[3]
    for i in (pages["owner"] != 0).nonzero()[0]:
        n = int(pages["num_tokens"][i])
        if n > page_tokens:
            ok[i] = False
            continue
        got = words_checksum_np(kv_words[i][:, :, :n], index[:, :, :n])
        ok[i] = got == int(pages["checksum"][i])
    return ok


def classify_host(tables: Tables, kv_words: np.ndarray) -> np.ndarray:
    return classify(tables.pages, tables.geometry.kv.page_tokens, host_checksums_ok(tables, kv_words))
