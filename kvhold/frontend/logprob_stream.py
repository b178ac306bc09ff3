"""The log-probs a token stream sends with its tokens, read from the journal's logprob area.

A token is sent with its log-probs, and these are final when it is (kvhold.protocol.journal:
they are committed before the count that covers the token, and `lp_done` says how far they are
final), so a stream that crosses an executor crash sends the same log-probs as an uninterrupted
run. Only after a pool restart can a token be counted while its log-probs are being recomputed
(the restored tokens'): `sendable` holds such tokens back until they are final.
"""
from __future__ import annotations


def sendable(journal, slot: int, request_id: int, prompt_len: int, count: int, finished: bool) -> int:
    """How many of the `count` generated tokens (a resumed prefix included) may be sent now."""
    asked = journal.asked_logprobs(slot)
    if finished or asked == (None, None):
        return count
    return sendable_from(asked, journal.lp_done(slot, request_id), prompt_len, count, finished)


def sendable_from(asked: tuple[int | None, int | None], lp_done: int, prompt_len: int, count: int,
                  finished: bool) -> int:
    """`sendable` from values read already: the request's (logprobs, prompt_logprobs) and its
    `lp_done` (read after `count`)."""
    logprobs, prompt_logprobs = asked
    if finished or (logprobs is None and prompt_logprobs is None):
        return count
    done = lp_done - prompt_len
    if prompt_logprobs is not None and done < 0:
        return 0
    return count if logprobs is None else max(0, min(count, done))


def fields(journal, slot: int, prompt_len: int, start: int, end: int,
           asked: tuple[int | None, int | None] | None = None) -> dict:
    """The Tokens fields (kvhold.protocol.messages) of generated tokens [start, end) (a resumed
    prefix counted): their log-probs if asked for, and the prompt's with the first (start 0).
    `asked`: the request's (logprobs, prompt_logprobs), when read already."""
    logprobs, prompt_logprobs = journal.asked_logprobs(slot) if asked is None else asked
    if logprobs is None and prompt_logprobs is None:
        return {}
    out = {}
    if logprobs is not None:
        out["logprobs"], out["top_ids"], out["top_logprobs"] = journal.logprobs_at(
            slot, prompt_len + start, prompt_len + end, logprobs)
        out["ranks"] = journal.ranks_at(slot, prompt_len + start, prompt_len + end)
    if prompt_logprobs is not None and start == 0:
        out["prompt_ids"] = journal.all_tokens(slot, prompt_len).tolist()
        out["prompt_logprobs"], out["prompt_top_ids"], out["prompt_top_logprobs"] = journal.logprobs_at(
            slot, 1, prompt_len, prompt_logprobs)
        out["prompt_ranks"] = journal.ranks_at(slot, 1, prompt_len)
    return out


def sliced(f: dict, start: int) -> dict:
    """`f` (fields of tokens from 0) for the tokens from `start` on (the prompt's only from 0)."""
    out = {k: f[k][start:] for k in ("logprobs", "ranks", "top_ids", "top_logprobs") if k in f}
    if start == 0:
        out.update({k: v for k, v in f.items() if k.startswith("prompt_")})
    return out
