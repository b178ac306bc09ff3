"""One OpenAI request's generation: text deltas from a kvhold stream, stop strings, SSE.

`Generation` turns a stream (kvhold.serving.backend.TokenStream) into text deltas. Stop strings are matched here,
on the detokenized text: text that could be the start of a stop string is held back
until it is known not to be, and when one matches the output ends before it and the
request is cancelled in the sidecar. A consumer that goes away (an HTTP client that
disconnects) cancels its request too. Executor crashes are invisible here: the
stream pauses, then continues with the next token.
"""
from __future__ import annotations

import asyncio
import json
import time

from kvhold.serving.backend import TokenStream
from kvhold.serving.openai_schema import ApiError, api_error_for
from kvhold.serving.tool_calls import ToolCall, ToolMode, ToolOutput, call_id

FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
_background: set[asyncio.Task] = set()


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops or [] if s]
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string matched)."""
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


class Generation:
    """`echo`: text output before the generated text (completions' echo: the prompt);
    `logprob_format`: entries -> the endpoint's logprobs object (kvhold.serving.logprobs), when
    the request asked for log-probs."""

    def __init__(self, stream: TokenStream, stops: list[str], echo: str | None = None,
                 logprob_format=None, score_only: bool = False, tools: ToolMode | None = None):
        self.stream = stream
        # chat's tools (kvhold.serving.tool_calls): the output read as tool calls, once it ends
        self.tools = ToolOutput(tools) if tools is not None and tools.mode != "none" else None
        self.tool_calls: list[ToolCall] = []
        self.score_only = score_only      # echo with max_tokens 0: the prompt scored, its one token dropped
        self.matcher = StopMatcher(stops)
        self.echo = echo
        self.logprob_format = logprob_format
        self.logprobs: list = []          # TokenLogprob of the tokens taken (an echoed prompt's first)
        self._logprobs_taken = 0
        self.finish_reason: str | None = None
        self.prompt_tokens = stream.prompt_tokens
        self.completion_tokens = 0
        self.tokens_seen = 0          # token events taken from the stream so far
        self.ended = False            # the stream's tokens are all taken: what follows is its end
        self.first_token_at: float | None = None
        self.token_times: list[float] = []      # when each token event arrived (time.monotonic())
        self.preemptions = 0
        self.cached_tokens = 0                  # prompt tokens the prefix cache served (from its Done)
        self.queue_s: float | None = None       # the sidecar's, from its Done (None: not known)
        self.prefill_s: float | None = None

    async def deltas(self):
        """Yield text pieces; finish_reason and usage are set once this ends."""
        try:
            async for piece in self._pieces():
                if self.tools is not None:
                    piece = self.tools.push(piece)
                if piece:
                    yield piece
            if self.tools is not None:
                rest, self.tool_calls = self.tools.finish()
                self.finish_reason = self.tools.finish_reason(self.tool_calls, self.finish_reason)
                if rest:
                    yield rest
        finally:
            if self.finish_reason is None and not self.stream.finished:
                task = asyncio.get_running_loop().create_task(self.stream.cancel())
                _background.add(task)
                task.add_done_callback(_background.discard)

    def logprob_chunk(self, empty: bool = False):
        """The logprobs object of the tokens taken since the last call; None when the request
        asked for none, or (unless `empty`) when no token was taken."""
        if self.logprob_format is None:
            return None
        entries, self._logprobs_taken = self.logprobs[self._logprobs_taken:], len(self.logprobs)
        return self.logprob_format(entries) if entries or empty else None

    def _echo(self):
        """The echoed prompt, with its log-probs (they come with the first tokens)."""
        self.logprobs.extend(self.stream.prompt_logprobs or [])
        echo, self.echo = self.echo, None
        return echo

    async def _scored(self):
        """Score only: the echoed prompt and its log-probs, which come with the first token; that
        token (the sidecar generates at least one) is neither shown nor counted."""
        async for _ in self.stream:
            break
        if self.echo is not None:
            yield self._echo()
        if not self.stream.finished:
            await self.stream.cancel()
        result = await self.stream.result()
        self.ended = True
        self.preemptions, self.cached_tokens = result.preemptions, result.cached_tokens
        self.queue_s, self.prefill_s = result.queue_s, result.prefill_s
        self.prompt_tokens = result.prompt_tokens
        if result.finish_reason == "error":
            raise ApiError(500, "the request failed in the engine", type="server_error")
        self.completion_tokens, self.finish_reason = 0, "length"

    async def _pieces(self):
        if self.score_only:
            async for piece in self._scored():
                yield piece
            return
        raw = []
        async for event in self.stream:
            if self.echo is not None:
                yield self._echo()
            if event.logprob is not None:
                self.logprobs.append(event.logprob)
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
            self.token_times.append(now)
            self.completion_tokens += 1
            self.tokens_seen += 1
            raw.append(event.text)
            out, stopped = self.matcher.push(event.text)
            yield out
            if stopped:
                self.ended = True
                await self.stream.cancel()
                self.finish_reason = "stop"
                return
        result = await self.stream.result()
        if self.echo is not None:          # no token came
            yield self._echo()
        self.ended = True
        self.preemptions = result.preemptions
        self.cached_tokens = result.cached_tokens
        self.queue_s, self.prefill_s = result.queue_s, result.prefill_s
        self.prompt_tokens = result.prompt_tokens     # a stream taken up again learns it here
        if result.finish_reason == "error":
            raise ApiError(500, "the request failed in the engine", type="server_error")
        joined = "".join(raw)
        out, stopped = self.matcher.push(result.text[len(joined):] if result.text.startswith(joined) else "")
        yield out
        if not stopped:
            yield self.matcher.flush()
        self.completion_tokens = result.completion_tokens if not stopped else self.completion_tokens
        self.finish_reason = "stop" if stopped else FINISH_REASONS.get(result.finish_reason, "stop")

    @property
    def usage(self) -> dict:
        # cached_tokens: prompt tokens whose KV the prefix cache served (--enable-prefix-caching);
        # KV recovered from kvhold's pages after a crash is not a cache hit
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def sse(payload, event_id: str | None = None) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}data: {data}\n\n".encode()


class EventIds:
    """The `id:` of a resumable stream's events (kvhold.serving.stream_resume): STREAM-N, the
    stream id and N the number of the request's tokens the text through this event
    covers (0 for a chat stream's first chunk); the events after the last token (the rest of
    the text, the finish chunk, the usage chunk) continue from there, one each, so that the
    numbers only grow. Events numbered `after` or lower are not sent: a stream taken up again
    from its first token, numbered the same way, goes on right after the last event the client
    got."""

    def __init__(self, stream_id: str, after: int = -1):
        self.stream_id, self.after = stream_id, after
        self.last = -1

    def event(self, payload, gen: "Generation", first: bool = False) -> bytes:
        if first:
            n = 0
        elif not gen.ended:
            n = gen.tokens_seen
        else:
            n = max(self.last, gen.tokens_seen) + 1
        self.last = n
        return sse(payload, f"{self.stream_id}-{n}") if n > self.after else b""


class ResponseShape:
    """The JSON objects of one endpoint: `chat` or `completion`, full or as chunks."""

    def __init__(self, kind: str, stream_id: str, model: str):
        self.chat = kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{stream_id}"
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text: str, finish_reason: str, index: int = 0, logprobs=None,
               tool_calls: list[ToolCall] = ()) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message = {"role": "assistant", "content": text or None,
                           "tool_calls": self.tool_calls(tool_calls, index)}
            return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def full(self, text: str, finish_reason: str, usage: dict, logprobs=None, tool_calls=(),
             prompt_logprobs=None) -> dict:
        choice = self.choice(text, finish_reason, logprobs=logprobs, tool_calls=tool_calls)
        if prompt_logprobs is not None and not self.chat:
            choice["prompt_logprobs"] = prompt_logprobs
        out = self.full_choices([choice], usage)
        if prompt_logprobs is not None and self.chat:
            out["prompt_logprobs"] = prompt_logprobs       # vLLM's place for chat
        return out

    def tool_calls(self, calls: list[ToolCall], index: int = 0, delta: bool = False) -> list[dict]:
        """A choice's calls as OpenAI lists them (`delta`: in a chunk, each with its index)."""
        return [{**({"index": i} if delta else {}), "id": call_id(f"{self.id}-{index}", i), "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]

    def tool_chunk(self, calls: list[ToolCall], index: int = 0) -> dict:
        """A chunk that carries a choice's tool calls, each whole."""
        choice = {"index": index, "delta": {"tool_calls": self.tool_calls(calls, index, delta=True)},
                  "logprobs": None, "finish_reason": None}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def full_choices(self, choices: list[dict], usage: dict) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": choices, "usage": usage}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              index: int = 0, logprobs=None) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else (
                {"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}


KEEPALIVE = b": keepalive\n\n"      # an SSE comment: clients skip it, proxies see traffic


async def with_keepalives(pieces, interval_s: float):
    """`pieces` (an async iterator), with None yielded after each `interval_s` of silence: a
    stream that pauses (a failover, a sidecar restart) keeps its connection through proxies
    that close idle ones. The pending item is awaited on, never cancelled."""
    it = pieces.__aiter__()
    if interval_s <= 0:
        async for piece in it:
            yield piece
        return
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=interval_s)
            if not done:
                yield None
                continue
            try:
                piece = nxt.result()
            except StopAsyncIteration:
                return
            yield piece
            nxt = asyncio.ensure_future(it.__anext__())
    finally:
        if not nxt.done():
            nxt.cancel()              # the consumer went away: the generator's finally runs
            try:
                await nxt
            except BaseException:     # noqa: BLE001 - its cancellation or its end, as expected
                pass
        if hasattr(it, "aclose"):
            await it.aclose()


async def sse_body(gen: Generation, shape: ResponseShape, include_usage: bool, on_end=None,
                   ids: EventIds | None = None, continuous_usage: bool = False,
                   keepalive_s: float = 0.0):
    """The SSE byte stream of one streaming response, ending with `data: [DONE]`; with `ids`,
    its events carry ids and those up to `ids.after` are left out (a resumed stream);
    `continuous_usage`: every chunk carries the usage so far (vLLM's continuous_usage_stats);
    `keepalive_s`: an SSE comment after each such silence (kept across a failover's pause)."""
    def event(payload, first=False) -> bytes:
        if continuous_usage and payload.get("choices"):
            payload = {**payload, "usage": gen.usage}
        return sse(payload) if ids is None else ids.event(payload, gen, first)
    try:
        if shape.chat:
            if out := event(shape.chunk(None, first=True), first=True):
                yield out
        async for piece in with_keepalives(gen.deltas(), keepalive_s):
            if piece is None:
                yield KEEPALIVE
            elif out := event(shape.chunk(piece, logprobs=gen.logprob_chunk())):
                yield out
        if gen.tool_calls and (out := event(shape.tool_chunk(gen.tool_calls))):
            yield out
        if out := event(shape.chunk(None, gen.finish_reason, logprobs=gen.logprob_chunk())):
            yield out
        if include_usage and (out := event(shape.usage_chunk(gen.usage))):
            yield out
    except ApiError as exc:
        yield sse(exc.body())
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report in-band
        yield sse(api_error_for(exc).body())
    finally:
        if on_end is not None:
            on_end(gen)
    yield sse("[DONE]")


def summed_usage(gens: list["Generation"], prompts_of: list[int]) -> dict:
    """The usage of several choices: each distinct prompt counted once (choices of one prompt
    share it, as OpenAI counts), completions summed."""
    seen, prompt, cached = set(), 0, 0
    for g, p in zip(gens, prompts_of):
        if p not in seen:
            seen.add(p)
            prompt += g.prompt_tokens or 0
            cached += g.cached_tokens
    completion = sum(g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


async def multi_sse_body(gens: list["Generation"], prompts_of: list[int], shape: ResponseShape,
                         include_usage: bool, on_end, keepalive_s: float = 0.0):
    """The SSE stream of a request with several choices (a batch of prompts, n > 1): each
    choice's chunks carry its index, in the order they come; then each finish chunk, the usage
    (summed) and `data: [DONE]`. Not resumable by Last-Event-ID (no event ids)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: "Generation"):
        try:
            if shape.chat:
                await queue.put(("chunk", shape.chunk(None, first=True, index=i)))
            async for piece in gen.deltas():
                await queue.put(("chunk", shape.chunk(piece, index=i, logprobs=gen.logprob_chunk())))
            if gen.tool_calls:
                await queue.put(("chunk", shape.tool_chunk(gen.tool_calls, index=i)))
            await queue.put(("chunk", shape.chunk(None, gen.finish_reason, index=i,
                                                  logprobs=gen.logprob_chunk())))
        except Exception as exc:  # noqa: BLE001 - reported in-band, as one choice's error
            await queue.put(("error", exc))
        finally:
            await queue.put(("done", i))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    left = len(tasks)
    try:
        while left:
            try:
                kind, item = await asyncio.wait_for(queue.get(), keepalive_s) if keepalive_s > 0 \
                    else await queue.get()
            except asyncio.TimeoutError:
                yield KEEPALIVE
                continue
            if kind == "done":
                left -= 1
            elif kind == "error":
                yield sse(api_error_for(item).body())
            else:
                yield sse(item)
        if include_usage:
            yield sse(shape.usage_chunk(summed_usage(gens, prompts_of)))
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        for t in tasks:
            try:
                await t
            except BaseException:  # noqa: BLE001 - cancelled with the response
                pass
        for g in gens:
            on_end(g)
    yield sse("[DONE]")
