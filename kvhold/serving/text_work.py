"""Request text worked off the HTTP server's event loop: parsing bodies, chat templates,
tokenization, detokenization.

One event loop answers every stream, /health and /metrics of the HTTP server, so work whose
cost grows with a request's size runs on `TEXT_THREADS` worker threads instead (as the
frontend's admission tokenizes, kvhold.frontend.admission): a body's JSON parse and checks,
the chat template, the tokenizer (its `encode_batch_fast` and `decode_batch`, which release
the GIL while they run; its `encode` and `decode` hold it throughout), and the JSON of a large
answer (/tokenize's ids). Python work on a worker thread shares the GIL with the loop by the
interpreter's switch interval, so the loop keeps its turns.

Sizes: the text that gets tokenized (a /tokenize prompt, a chat's rendered prompt) is bounded
by the sidecar's `--max-prompt-bytes`, as a completion's text prompt is in the frontend
(PROMPT_TOO_LARGE, HTTP 413): first by its length in characters on the loop, which costs
nothing, so an oversized body is refused before any work; then exactly, in the worker.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from kvhold.protocol.errors import PromptTooLarge
from kvhold.protocol.sampling import check_prompt_size
from kvhold.serving.chat_template import ChatTemplate, TemplateError
from kvhold.serving.openai_schema import bad_request, parse_body

TEXT_THREADS = 2         # one huge body does not hold up every other request's text


class TextWork:
    """The HTTP server's worker threads for request text, over one tokenizer and chat template."""

    def __init__(self, tokenizer, template: ChatTemplate, max_prompt_bytes: int):
        self.tokenizer, self.template, self.max_prompt_bytes = tokenizer, template, max_prompt_bytes
        self._pool = ThreadPoolExecutor(TEXT_THREADS, thread_name_prefix="http-text")

    async def run(self, fn, *args):
        """fn(*args) on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def parse(self, raw: bytes, model):
        """parse_body (kvhold.serving.openai_schema) on a worker thread."""
        return await self.run(parse_body, raw, model)

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        check_prompt_size(text, self.max_prompt_bytes, exact=False)
        return await self.run(self._encode, text, add_special_tokens)

    async def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The token ids of `messages` (and `tools`) through the chat template (no special tokens
        added: the template writes them)."""
        chars = sum(len(m["content"]) for m in messages) + (len(json.dumps(tools)) if tools else 0)
        if chars > self.max_prompt_bytes:
            raise PromptTooLarge(f"the messages have {chars} characters, more than the limit of "
                                 f"{self.max_prompt_bytes} bytes (--max-prompt-bytes)")
        return await self.run(self._chat_ids, messages, tools)

    async def decode(self, ids: list[int]) -> str:
        return await self.run(self._decode, ids)

    async def json(self, obj) -> bytes:
        """`obj` as compact JSON, as a JSONResponse renders it."""
        return await self.run(_dumps, obj)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- on a worker thread
    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        check_prompt_size(text, self.max_prompt_bytes, exact=True)
        return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        try:
            text = self.template.render(messages, tools)
        except TemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        return self._encode(text, add_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        bad = next((t for t in ids if t >= size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is not in the vocabulary ({size} ids)", param="tokens",
                              code="invalid_value")
        return self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
