"""The sidecar's periodic stats line, as vLLM prints one: throughput and load at a glance.

Every `logs.stats_interval_s` (default 10 s) while there is work, or was since the last
line, the sidecar logs at INFO: prompt and generation throughput over the interval (tokens
admitted and streamed, counted by the frontend), running and waiting requests (waiting:
admitted, no token yet), the KV pages in use out of the pool (idle prefix-cache pages,
evicted first when the pool needs room, count as free, as vLLM counts them), the prefix
cache's hit rate over the requests finished in the interval, and the executor restarts and
recoveries since the last line. An idle sidecar stays silent.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("kvhold.stats")


@dataclass(slots=True)
class Sample:
    ns: int
    prompt_tokens: int
    generated_tokens: int
    recoveries: int
    cache_queries: int = 0
    cache_hits: int = 0


class StatsLog:
    def __init__(self, interval_s: float):
        self.interval_ns = int(interval_s * 1e9)
        self._last: Sample | None = None
        self._next_ns = 0

    def due(self, now: int) -> bool:
        return self.interval_ns > 0 and now >= self._next_ns

    def line(self, now: int, *, prompt_tokens: int, generated_tokens: int, running: int, waiting: int,
             pages_used: int, pages_total: int, recoveries: int,
             prefix_cache: dict | None = None) -> str | None:
        """The line for this interval (None: nothing happened), and the next interval starts.
        `prefix_cache`: the frontend's prefix-cache counts (None without a cache)."""
        cache = prefix_cache or {}
        sample = Sample(now, prompt_tokens, generated_tokens, recoveries,
                        cache.get("queries", 0), cache.get("hits", 0))
        last, self._last, self._next_ns = self._last, sample, now + self.interval_ns
        if last is None:
            return None
        seconds = max(1e-9, (now - last.ns) / 1e9)
        new_prompt = prompt_tokens - last.prompt_tokens
        new_generated = generated_tokens - last.generated_tokens
        if not (new_prompt or new_generated or running or waiting):
            return None
        text = (f"prompt throughput {new_prompt / seconds:.1f} tokens/s, generation throughput "
                f"{new_generated / seconds:.1f} tokens/s, running {running}, waiting {waiting}, KV pages "
                f"{pages_used}/{pages_total} ({100 * pages_used / max(1, pages_total):.1f}% used)")
        queries = sample.cache_queries - last.cache_queries
        if prefix_cache is not None and queries > 0:
            text += f", prefix cache hit rate {100 * (sample.cache_hits - last.cache_hits) / queries:.1f}%"
        if recoveries > last.recoveries:
            text += f", recoveries {recoveries - last.recoveries}"
        return text

    def tick(self, now: int, **numbers) -> None:
        if self.due(now):
            text = self.line(now, **numbers)
            if text:
                log.info("%s", text)
