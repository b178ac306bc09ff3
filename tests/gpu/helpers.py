"""Helpers shared by the GPU tests (importing this module needs no GPU)."""
from __future__ import annotations


def plan(seq_specs):
    """A step's schedule from (tokens, num_computed, tokens_this_step, pages) per sequence."""
    from kvhold.executor.scheduler import Scheduled
    from kvhold.executor.sequence import Sequence
    from kvhold.protocol.sampling import SamplingParams

    out = []
    for slot, (tokens, computed, n, pages) in enumerate(seq_specs):
        seq = Sequence(slot=slot, request_id=slot + 1, prompt_len=len(tokens), tokens=tokens,
                       sampling=SamplingParams(max_tokens=9, seed=0, temperature=0.0, ignore_eos=True))
        seq.num_computed, seq.pages = computed, pages
        out.append(Scheduled(seq, n))
    return out


def kill_active_at(sc, threshold: int):
    """A `wait_all` event callback that SIGKILLs `sc`'s active executor at the `threshold`-th
    streamed event (a sidecar with no standby to wait for)."""
    import os
    import signal

    seen = [0]

    def on_event(stream, event):
        seen[0] += 1
        if seen[0] == threshold:
            os.kill(sc.wait_steady(standbys=0)["pid"], signal.SIGKILL)
    return on_event
