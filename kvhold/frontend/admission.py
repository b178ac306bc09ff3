"""What an admission waits for off the sidecar's event loop: tokenization and durability.

The loop never waits on client input or on the disk (kvhold.frontend.frontend):
* **Tokenization.** A text prompt is checked against `--max-prompt-bytes` (its length in
  characters on the loop, a lower bound of its UTF-8 size; the exact size in the worker),
  then tokenized by `PromptTokenizer` on worker threads. It calls the Hugging Face
  tokenizer's `encode_batch_fast` with one text, which runs with the GIL released (its
  `encode` holds the GIL throughout; `encode_batch` also computes character offsets, whose
  release takes the GIL for ~0.1 s per MiB of text), and counts the tokens before it builds
  their list, so a prompt far over the context costs no list. The result is posted back
  to the loop.
* **Durability.** The admission record goes to the durable journal's group commit
  (kvhold.sidecar.durable_journal.GroupCommit); the loop acknowledges the request only
  when its batch is on disk.
A `Pending` admission is the loop's note of a request between the two: numbered and
counted against the free request slots, not yet in the shared-memory journal, unknown to
its client (which has no request id to cancel it by) until `Accepted`.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from kvhold.protocol.errors import PromptTooLong
from kvhold.protocol.sampling import SamplingParams, check_prompt_size

log = logging.getLogger(__name__)
TOKENIZER_THREADS = 2      # one huge prompt does not hold up every other text prompt


class PromptTokenizer:
    """Text prompts tokenized on worker threads; `on_done(future)` runs on a worker thread."""

    def __init__(self, tokenizer, max_prompt_bytes: int, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_prompt_bytes = max_prompt_bytes
        self.max_seq_len = max_seq_len
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, text: str, on_done: Callable[[Future], None]) -> Future:
        check_prompt_size(text, self.max_prompt_bytes, exact=False)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        future = self._pool.submit(self._encode, text)
        future.add_done_callback(on_done)
        return future

    def _encode(self, text: str) -> list[int]:
        check_prompt_size(text, self.max_prompt_bytes, exact=True)
        encoding = self.tokenizer.encode_batch_fast([text])[0]    # GIL released while it runs
        if len(encoding) >= self.max_seq_len:
            raise PromptTooLong(f"prompt of {len(encoding)} tokens does not fit the context of "
                                f"{self.max_seq_len} tokens")
        return encoding.ids

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class Pending:
    """An admission numbered, counted against the free slots, waiting for its batch on disk."""

    identity: bytes
    tag: int
    request_id: int
    prompt_ids: list[int]
    prefix: list[int]
    params: SamplingParams        # as journaled: its seed resolved (SamplingParams.as_journaled)
    body: dict
    durable: bool = False         # its batch is on disk: it is admitted at the next loop turn
