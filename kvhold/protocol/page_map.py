"""A compact picture of the KV page pool for status displays (`kvhold top`).

The sidecar builds it from a page-table snapshot; viewers decode it without
touching shared memory. The pool is cut into at most `max_cells` equal runs of
consecutive pages; each run becomes one character:

    '.' all free        '+' partly committed    '#' all committed
    'q' any quarantined 'w' any being written    'x' any bad

Rare states win over common ones (one bad page marks its whole cell), so a
problem never disappears in the downsampling. One vectorised pass: cheap enough
for every status request even on a pool of millions of pages.
"""
from __future__ import annotations

import numpy as np

from kvhold.protocol.layout import PageFlag

CELL_CHARS = ".+#qwx"
LEGEND = {".": "free", "+": "partly committed", "#": "committed", "q": "quarantined",
          "w": "being written", "x": "bad"}
_COMMITTED, _QUARANTINED, _WRITING, _BAD = 1, 2, 3, 4   # per-page rank; 0 is free


def page_ranks(snap: np.ndarray) -> np.ndarray:
    """Per page: 0 free, 1 committed, 2 quarantined, 3 being written, 4 bad."""
    ranks = np.where(snap["owner"] != 0, _COMMITTED, 0).astype(np.uint8)
    ranks[(snap["flags"] & PageFlag.QUARANTINED).astype(bool)] = _QUARANTINED
    ranks[(snap["version"] & 1).astype(bool)] = _WRITING
    ranks[(snap["flags"] & PageFlag.BAD).astype(bool)] = _BAD
    return ranks


def page_map(snap: np.ndarray, max_cells: int = 1024) -> dict:
    """{"pages_per_cell": k, "cells": str} for a page-table snapshot."""
    ranks = page_ranks(snap)
    n = len(ranks)
    if n == 0:
        return {"pages_per_cell": 1, "cells": ""}
    per_cell = -(-n // max_cells)
    starts = np.arange(0, n, per_cell)
    worst = np.maximum.reduceat(ranks, starts)
    committed = np.add.reduceat((ranks == _COMMITTED).astype(np.int64), starts)
    sizes = np.diff(np.append(starts, n))
    # 0 '.', 1 '+', 2 '#', then the rare states at their rank + 1
    code = np.where(worst > _COMMITTED, worst + 1,
                    np.where(committed == 0, 0, np.where(committed == sizes, 2, 1)))
    table = np.frombuffer(CELL_CHARS.encode(), dtype=np.uint8)
    return {"pages_per_cell": int(per_cell), "cells": table[code].tobytes().decode()}
