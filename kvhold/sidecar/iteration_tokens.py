"""The tokens each engine step computed (prefill and decode), as vLLM's `iteration_tokens_total`
histogram counts them: the active executor lists its steps' counts in each StepDone
(kvhold.protocol.messages), the memory owner counts them here, and the status carries the
histogram to the HTTP API's /metrics (kvhold.serving.metrics). It counts from the sidecar's
start: a restarted sidecar starts again at zero (a counter reset, as Prometheus reads it)."""
from __future__ import annotations

import bisect

BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)     # vLLM's


class IterationTokens:
    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)      # per bucket (le BUCKETS[i]), then above the last
        self.sum = 0

    def observe(self, step_tokens: list[int]) -> None:
        for n in step_tokens:
            if isinstance(n, int) and n > 0:
                self.counts[bisect.bisect_left(BUCKETS, n)] += 1
                self.sum += n

    def status(self) -> dict:
        """{"buckets": upper bounds, "counts": steps per bucket (the last: above them), "sum"}."""
        return {"buckets": list(BUCKETS), "counts": list(self.counts), "sum": self.sum}
