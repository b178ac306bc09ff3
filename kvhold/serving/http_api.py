"""The OpenAI-compatible HTTP API of `kvhold serve` (FastAPI), over the async SDK.

Routes: GET /v1/models, POST /v1/completions and /v1/chat/completions (SSE when
`stream` is true), GET /v1/streams/{stream_id} (a stream taken up again after the HTTP
server restarted, from its Last-Event-ID: kvhold.serving.stream_resume), GET /health,
GET /metrics (Prometheus). Every /v1 route asks for
`Authorization: Bearer <key>` when an API key is configured; /health and /metrics
stay open for probes and scrapers. Errors are OpenAI-shaped JSON
({"error": {"message", "type", "param", "code"}}) and never stop the server nor close the
keep-alive connection: bad input is a 4xx naming the parameter (a body over MAX_BODY_BYTES
or a request too large for the sidecar a 413), a bug a 500. /openapi.json declares both
request bodies (the pydantic models of kvhold.serving.openai_schema).

The app is backed by one local sidecar (`SidecarBackend`, `kvhold serve`) or by the
sidecars of a registry (`kvhold.serving.router_http.RouterBackend`, `kvhold router`): a backend
is what kvhold.serving.backend.Backend declares (`submit` a checked request, `health`,
`render_metrics`, `attach` where it resumes streams), and its `metrics` count HTTP requests.

/health (one sidecar) is 200 only when a request can be served now: the weights are sealed
and an active executor is ready with a live heartbeat lease. During a failover, or while
draining after SIGTERM, it is 503 with the reason; so it is while a crash of the
active executor would not be survived (executors in a respawn loop, or one that
cannot be spawned: the sidecar's `protection` status). Streams do not time out during a
failover: the SDK waits as long as the sidecar sends keepalives.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvhold.client.aclient import AsyncClient
from kvhold.protocol.errors import KvholdError, NotFound
from kvhold.protocol.sampling import RequestInput
from kvhold.protocol.wire import WireError
from kvhold.serving.backend import Backend, TokenStream
from kvhold.serving.chat_template import ChatTemplate, token_text
from kvhold.serving.generation import (EventIds, Generation, ResponseShape, multi_sse_body, sse_body,
                                       summed_usage)
from kvhold.serving.http_guards import BODY_TIMEOUT_S, BodyDeadline
from kvhold.serving.metrics import SidecarMetrics
from kvhold.serving import stream_resume
from kvhold.serving.logprobs import LogprobFormat
from kvhold.serving.openai_schema import (MAX_BODY_BYTES, ApiError, ChatRequest, CompletionRequest,
                                          DetokenizeRequest, TokenizeRequest, api_error_for, bad_request,
                                          from_validation_errors, too_large)
from kvhold.serving.text_work import TextWork
from kvhold.serving.tool_calls import ToolMode, parser_for_template
from kvhold.sidecar.config import DEFAULT_MAX_PROMPT_BYTES

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class AppSettings:
    endpoint: str                 # the sidecar's client endpoint (ipc:// or tcp://)
    model_dir: Path | None        # for the tokenizer and chat template
    served_model_name: str
    context_len: int              # the sidecar's max sequence length (prompt + output)
    lease_ms: int = 1000          # heartbeat lease: an older heartbeat is not "live"
    api_key: str | None = None
    client_timeout: float = 30.0  # sidecar silence (no keepalive either) that fails a request
    poll_interval_s: float = 1.0  # status polls that feed /metrics
    body_timeout_s: float = BODY_TIMEOUT_S   # a slower request body is answered 408
    routing_id: bytes | None = None   # the SDK's ZeroMQ routing id (None: a random one)
    stream_dir: Path | None = None    # where resumable streams' records go (None: streams not resumable)
    sse_keepalive_s: float = 10.0     # a stream silent this long gets an SSE comment (0: never)
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES  # the sidecar's: text tokenized here is bounded alike
    chat_template: str | None = None  # --chat-template's text (None: the checkpoint's)
    tool_call_parser: str = "auto"    # tool_choice auto's (kvhold.serving.tool_calls); auto: by the template


class Gate:
    """Admission while serving; after SIGTERM, refuse new work and track what is left."""

    def __init__(self):
        self.draining = False
        self.active: set[Generation] = set()

    @property
    def idle(self) -> bool:
        return all(g.stream.finished for g in self.active)


def serving_state(status: dict, lease_ms: int) -> tuple[bool, str]:
    """Can the sidecar serve a request now? (ok, reason)."""
    if status.get("weights", {}).get("state") != "sealed":
        return False, f"weights not loaded (state {status.get('weights', {}).get('state')!r})"
    health = status.get("health")
    if isinstance(health, dict) and health.get("action") == "drain":
        return False, f"draining on hardware health: {health.get('reason')}"
    admissions = status.get("admissions")
    if isinstance(admissions, dict) and not admissions.get("open", True):
        return False, "not admitting: " + "; ".join(admissions.get("closed_by", {}).values())
    protection = status.get("protection")
    if isinstance(protection, dict) and protection.get("ok") is False:
        return False, f"no crash protection: {protection.get('reason')}"
    active = [e for e in status.get("executors", []) if e.get("role") == "active"]
    if not active:
        return False, "no active executor (failover or start-up in progress)"
    e = active[0]
    if not e.get("ready"):
        return False, f"active executor pid {e['pid']} is not ready"
    if e.get("heartbeat_age_ms", 0) > lease_ms:
        return False, f"active executor pid {e['pid']} missed its heartbeat lease"
    return True, f"active executor pid {e['pid']} serving"


class _ApiMiddleware:
    """Bearer-key check on /v1 routes, /tokenize, /detokenize and the API's description (/docs,
    /redoc, /openapi.json), request counting, and X-Request-Id echoed on the response, as plain
    ASGI (streams untouched). /health, /metrics and /version stay open."""

    def __init__(self, app, settings: AppSettings, metrics):
        self.app, self.metrics = app, metrics
        self.key = settings.api_key.encode() if settings.api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in _ENDPOINTS else "other"
        if self.key is not None and _guarded(path) and not self._authorized(scope):
            err = ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
            self.metrics.http.labels(endpoint, "401").inc()
            return await JSONResponse(err.body(), 401)(scope, receive, send)

        started = False
        request_id = dict(scope["headers"]).get(b"x-request-id")
        if request_id is not None and (len(request_id) > MAX_REQUEST_ID or not request_id.isascii()):
            request_id = None

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http.labels(endpoint, str(message["status"])).inc()
                if request_id is not None:        # echoed, as vLLM and proxies do
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", request_id)]}
            await send(message)
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:
            if started:             # a response is under way: only closing can end it
                raise
            # answered here, not re-raised: the server would close the keep-alive connection
            log.exception("unhandled error on %s", path)
            err = ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")
            await JSONResponse(err.body(), 500)(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


def _guarded(path: str) -> bool:
    return path.startswith(("/v1", "/docs/")) or path in _DESCRIPTION or path in _TOKENIZER or path in _ADMIN


_ADMIN = {"/reset_prefix_cache"}


_TOKENIZER = {"/tokenize", "/detokenize", "/tokenizer_info"}


_DESCRIPTION = {"/docs", "/redoc", "/openapi.json"}
_RESUME_DOC = {
    "summary": "Resume a streamed completion or chat completion",
    "description": "Continues an SSE stream of POST /v1/completions or /v1/chat/completions after "
                   "the connection broke (the HTTP server restarted): the events after the one "
                   "named by Last-Event-ID (each event's `id:` line, `<stream id>-<N>`), then "
                   "`data: [DONE]`, as the original stream would have sent them; without "
                   "Last-Event-ID, the whole stream. Only with the credential (Authorization) "
                   "that started it. 400: a malformed id; 404: nothing to resume (delivered, "
                   "cancelled, unknown, another credential's); 409: the stream is being sent elsewhere.",
    "parameters": [{"name": "Last-Event-ID", "in": "header", "required": False,
                    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}-[0-9]{1,10}$"},
                    "description": "the id of the last event received"}],
    "responses": {"200": {"description": "the rest of the stream",
                          "content": {"text/event-stream": {"schema": {"type": "string"}}}}},
}
_ENDPOINTS = {"/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics",
              "/tokenize", "/detokenize", "/version", "/reset_prefix_cache", "/tokenizer_info", "/ping",
              "/load"}
MAX_REQUEST_ID = 256        # an X-Request-Id longer than this is not echoed


class SidecarBackend:
    """One local sidecar: its async client, the status polls that feed /metrics, /health (a
    kvhold.serving.backend.Backend)."""
    resumes_streams = True

    def __init__(self, settings: AppSettings):
        self.settings = settings
        self.metrics = SidecarMetrics(settings.served_model_name)
        self._served = False            # it could serve once: past its start-up
        self.client: AsyncClient | None = None
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        self.client = AsyncClient(self.settings.endpoint, timeout=self.settings.client_timeout,
                                  identity=self.settings.routing_id)
        self._poller = asyncio.create_task(self.poll_forever())

    async def close(self) -> None:
        self._poller.cancel()
        await self.client.close()

    async def submit(self, request: RequestInput) -> TokenStream:
        return await self.client.submit(request)

    async def attach(self, request_id: int) -> TokenStream:
        return await self.client.attach(request_id)

    async def poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.settings.poll_interval_s)

    async def poll(self) -> dict | None:
        try:
            status = await asyncio.wait_for(self.client.status(), HEALTH_TIMEOUT_S)
        except (KvholdError, asyncio.TimeoutError) as exc:
            self.metrics.unavailable(f"sidecar not answering: {exc or type(exc).__name__}")
            return None
        self.metrics.observe(status)
        return status

    async def health(self) -> tuple[bool, dict]:
        status = await self.poll()
        if status is None:
            if not self._served:          # the port opens while the sidecar still starts
                return False, {"status": "starting", "reason": f"the sidecar is starting "
                               f"({self.metrics.status_error})"}
            return False, {"status": "unavailable", "reason": self.metrics.status_error}
        ok, reason = serving_state(status, self.settings.lease_ms)
        if not ok and not self._served:
            return False, {"status": "starting", "reason": reason}
        self._served = self._served or ok
        active = next((e for e in status["executors"] if e["role"] == "active"), None)
        return ok, {"status": "ok" if ok else "unavailable", "reason": reason,
                    "active_pid": active["pid"] if active else None,
                    "standbys_ready": sum(1 for e in status["executors"]
                                          if e["role"] == "standby" and e["ready"]),
                    "in_flight": status.get("requests", {}).get("in_flight", 0)}

    async def render_metrics(self) -> bytes:
        await self.poll()
        return self.metrics.render()

    async def reset_prefix_cache(self) -> None:
        await self.client.reset_prefix_cache()


class _Service:
    """What the routes share: the backend, tokenizer, template, metrics, gate."""

    def __init__(self, settings: AppSettings, backend: Backend):
        self.settings, self.backend, self.metrics = settings, backend, backend.metrics
        self.gate = Gate()
        self.template = ChatTemplate.for_checkpoint(settings.model_dir, settings.chat_template)
        self.text = TextWork(_load_tokenizer(settings.model_dir), self.template, settings.max_prompt_bytes)
        self.created = int(time.time())
        resumable = settings.stream_dir is not None and backend.resumes_streams
        self.records = stream_resume.StreamRecords(settings.stream_dir) if resumable else None

    @property
    def tokenizer(self):
        return self.text.tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.served_model_name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                                f"'{self.settings.served_model_name}'.", param="model",
                           code="model_not_found")

    def tokenizer_info(self) -> dict:
        cfg = {}
        path = Path(self.settings.model_dir) / "tokenizer_config.json" if self.settings.model_dir else None
        if path is not None and path.is_file():
            try:
                cfg = json.loads(path.read_text())
            except (OSError, ValueError):
                cfg = {}
        cfg = cfg if isinstance(cfg, dict) else {}
        return {**cfg, "tokenizer_class": cfg.get("tokenizer_class") or "PreTrainedTokenizerFast",
                "bos_token": self.template.bos_token or None, "eos_token": self.template.eos_token or None,
                "pad_token": token_text(cfg.get("pad_token")) or None,
                "chat_template": self.template.source, "model_max_length": self.settings.context_len}

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ApiError(501, "this server has no tokenizer (no tokenizer.json in the model "
                           "directory, or no --model for the router)", type="not_implemented",
                           code="no_tokenizer")
        return self.tokenizer

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._need_tokenizer()
        return await self.text.encode(text, add_special_tokens)

    async def detokenize(self, ids: list[int]) -> str:
        self._need_tokenizer()
        return await self.text.decode(ids)

    async def chat_prompt_ids(self, req: ChatRequest) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json: chat is unavailable", param="messages")
        messages = [m.for_template() for m in req.messages]
        return await self.text.chat_ids(messages, req.tools or None)

    def tool_mode(self, req) -> ToolMode | None:
        """A chat request's tool mode (kvhold.serving.tool_calls); None for completions."""
        if not isinstance(req, ChatRequest):
            return None
        parser = self.settings.tool_call_parser
        return req.tool_mode(parser_for_template(self.template.source) if parser == "auto" else parser)

    def max_tokens(self, requested: int | None, prompt_len: int | None, default: int | None,
                   prompt_param: str = "prompt") -> int:
        """Checked max_tokens; `default` None means "the rest of the context" (chat)."""
        ctx = self.settings.context_len
        if prompt_len is not None and prompt_len >= ctx:
            raise bad_request(f"This model's maximum context length is {ctx} tokens, but the prompt "
                              f"has {prompt_len} tokens.", param=prompt_param, code="context_length_exceeded")
        if requested is not None and requested > ctx:
            raise bad_request(f"max_tokens ({requested}) exceeds this model's context length ({ctx} "
                              "tokens, prompt + completion).", param="max_tokens",
                              code="context_length_exceeded")
        if requested is not None:
            return requested
        return default if default is not None else ctx - (prompt_len or 0)

    async def serve(self, req, kind: str, prompt: dict, max_tokens: int, owner: str):
        """One choice; a stream is resumable by `owner` (stream_resume.owner_of its credential)."""
        if self.gate.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable",
                           code="shutting_down")
        t0 = time.monotonic()
        stream = await self.backend.submit(_request(prompt, req.sampling(max_tokens)))
        gen = self._generation(req, kind, prompt, stream)
        self.gate.active.add(gen)
        sid = stream_resume.new_stream_id()
        shape = ResponseShape(kind, sid, self.settings.served_model_name)
        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

        self.metrics.observe_choices(1)

        def on_end(g: Generation) -> None:
            self._ended(g, t0, endpoint, max_tokens)
            self.metrics.observe_choices_ended([g.completion_tokens])
        if req.stream:
            ids = None
            if self.records is not None:   # what a resume needs and the sidecar does not keep
                self.records.write(sid, {
                    "request_id": stream.request_id, "owner": owner,
                    "kind": kind, "stop": list(req.stop or []), "include_usage": req.include_usage,
                    "continuous_usage": req.continuous_usage,
                    "created": shape.created, "prompt_tokens": stream.prompt_tokens,
                    "echo": gen.echo, "logprobs": gen.logprob_format is not None,
                    "tools": gen.tools.tool.to_record() if gen.tools is not None else None})
                ids = EventIds(sid)
            return self.stream_response(gen, shape, req.include_usage, on_end, ids, req.continuous_usage)
        try:
            text = "".join([piece async for piece in gen.deltas()])
        finally:
            on_end(gen)
        return JSONResponse(shape.full(text, gen.finish_reason, gen.usage, gen.logprob_chunk(empty=True),
                                       gen.tool_calls, self._prompt_logprobs(req, gen)))

    def _prompt_logprobs(self, req, gen: Generation) -> list | None:
        """vLLM's prompt_logprobs of a choice, when the request asked for them."""
        if req.prompt_logprobs is None:
            return None
        return LogprobFormat(self.tokenizer).prompt(gen.stream.prompt_logprobs or [])

    def _generation(self, req, kind: str, prompt: dict, stream) -> Generation:
        """The Generation of one choice: its stop strings, the echoed prompt (completions'
        echo) and the format of its log-probs, if asked for (kvhold.serving.logprobs)."""
        echo = None
        if getattr(req, "echo", False):
            echo = prompt.get("prompt")
            if echo is None:
                echo = self._need_tokenizer().decode(prompt["prompt_ids"], skip_special_tokens=False)
        asked = "logprobs" in req.logprob_params()        # the generated tokens' (and echo's)
        return Generation(stream, req.stop, echo, self._logprob_format(kind) if asked else None,
                          score_only=getattr(req, "score_only", False), tools=self.tool_mode(req))

    def _logprob_format(self, kind: str):
        fmt = LogprobFormat(self.tokenizer)
        if kind == "chat":
            return fmt.chat
        offset = 0

        def completion(entries):
            nonlocal offset
            obj, offset = fmt.completion(entries, offset)
            return obj
        return completion

    def _ended(self, g: Generation, received: float, endpoint: str, max_tokens: int | None = None) -> None:
        """A generation is over (answered, streamed to its end, or cut off): count it."""
        self.gate.active.discard(g)
        if g.first_token_at is not None:
            self.metrics.ttft.labels(endpoint).observe(g.first_token_at - received)
        self.metrics.observe_request(
            received=received, first_token=g.first_token_at, token_times=g.token_times, end=time.monotonic(),
            prompt_tokens=g.prompt_tokens or 0, generation_tokens=g.completion_tokens,
            preemptions=g.preemptions, finish_reason=g.finish_reason, queue_s=g.queue_s, prefill_s=g.prefill_s,
            max_tokens=max_tokens)

    async def serve_choices(self, req, kind: str, prompts: list[dict], max_tokens: list[int]):
        """Several choices: each prompt of a batch, `req.n` times (choice j with seed + j), as
        one request each in the sidecar; the answer lists them by index (prompt-major, as
        OpenAI and vLLM do), usage summed. A stream of several choices has no event ids."""
        if self.gate.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable",
                           code="shutting_down")
        if req.continuous_usage:
            raise bad_request("continuous_usage_stats is not supported with several choices",
                              param="stream_options", code="unsupported_value")
        t0 = time.monotonic()
        gens, prompts_of, limits = [], [], {}
        try:
            for p, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
                for j in range(req.n):
                    stream = await self.backend.submit(_request(prompt, req.sampling(limit, choice=j)))
                    gens.append(self._generation(req, kind, prompt, stream))
                    limits[id(gens[-1])] = limit
                    prompts_of.append(p)
        except BaseException:
            for g in gens:          # the choices admitted before one was refused go too
                await g.stream.cancel()
            raise
        for g in gens:
            self.gate.active.add(g)
        for _ in prompts:
            self.metrics.observe_choices(req.n)
        shape = ResponseShape(kind, stream_resume.new_stream_id(), self.settings.served_model_name)

        endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"

        groups: dict[int, list[int]] = {}       # prompt -> its ended choices' generated tokens
        prompt_of = {id(g): p for g, p in zip(gens, prompts_of)}

        def on_end(g: Generation) -> None:
            self._ended(g, t0, endpoint, limits.get(id(g)))
            done = groups.setdefault(prompt_of[id(g)], [])
            done.append(g.completion_tokens)
            if len(done) == req.n:
                self.metrics.observe_choices_ended(done)
        if req.stream:
            return StreamingResponse(multi_sse_body(gens, prompts_of, shape, req.include_usage, on_end,
                                                    self.settings.sse_keepalive_s),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

        async def collect(g: Generation) -> str:
            try:
                return "".join([piece async for piece in g.deltas()])
            finally:
                on_end(g)
        texts = await asyncio.gather(*(collect(g) for g in gens))
        choices = [shape.choice(text, g.finish_reason, i, g.logprob_chunk(empty=True), g.tool_calls)
                   for i, (text, g) in enumerate(zip(texts, gens))]
        prompt_lps = [self._prompt_logprobs(req, g) for g in gens]
        if kind == "completion" and req.prompt_logprobs is not None:
            for choice, lps in zip(choices, prompt_lps):
                choice["prompt_logprobs"] = lps
        out = shape.full_choices(choices, summed_usage(gens, prompts_of))
        if kind == "chat" and req.prompt_logprobs is not None:
            out["prompt_logprobs"] = prompt_lps[0]          # one prompt
        return JSONResponse(out)

    def stream_response(self, gen, shape, include_usage, on_end, ids, continuous_usage=False) -> StreamingResponse:
        def ended(g: Generation) -> None:
            if ids is not None:
                self.records.remove(ids.stream_id)
            on_end(g)
        return StreamingResponse(sse_body(gen, shape, include_usage, ended, ids, continuous_usage,
                                          self.settings.sse_keepalive_s),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def resume(self, path_id: str, last_event_id: str | None, owner: str):
        """GET /v1/streams/{stream_id}: the events after Last-Event-ID (kvhold.serving.stream_resume),
        for the owner of the stream only."""
        if self.records is None:
            raise ApiError(501, "this server does not resume streams", type="not_implemented",
                           code="resume_unsupported")
        sid = stream_resume.parse_stream_id(path_id)
        after = stream_resume.parse_last_event_id(last_event_id, sid)
        if self.gate.draining:
            raise ApiError(503, "the server is shutting down", type="service_unavailable",
                           code="shutting_down")
        record = self.records.read(sid, owner)
        if record is None:      # another credential's stream is answered alike: it does not exist
            raise stream_resume.not_found(sid, "this server streamed no such response, or its stream ended here")
        rid = record["request_id"]
        if any(g.stream.request_id == rid for g in self.gate.active):
            raise ApiError(409, f"stream {sid} is being sent on another connection", code="stream_in_use")
        try:
            stream = await self.backend.attach(rid)
        except NotFound as exc:
            self.records.remove(sid)
            raise stream_resume.not_found(sid, str(exc)) from None
        except ValueError:
            raise ApiError(409, f"stream {sid} is being sent on another connection",
                           code="stream_in_use") from None
        gen = Generation(stream, record["stop"], record.get("echo"),
                         self._logprob_format(record["kind"]) if record.get("logprobs") else None,
                         tools=ToolMode.from_record(record.get("tools")))
        gen.prompt_tokens = record["prompt_tokens"]
        self.gate.active.add(gen)
        shape = ResponseShape(record["kind"], sid, self.settings.served_model_name)
        shape.created = record["created"]
        log.info("stream %s (request %#x) taken up again after event %d", sid, rid, after)
        return self.stream_response(gen, shape, record["include_usage"], self.gate.active.discard,
                                    EventIds(sid, after), bool(record.get("continuous_usage")))


def _owner(request: Request) -> str:
    """Who a stream belongs to: a hash of the request's credential (kvhold.serving.stream_resume)."""
    return stream_resume.owner_of(request.headers.get("authorization"))


def _request(prompt: dict, sampling: dict) -> RequestInput:
    """One choice's request ({'prompt': text} or {'prompt_ids': [...]}), checked before a
    backend sees it."""
    return RequestInput.check(prompt.get("prompt"), prompt.get("prompt_ids"), None, sampling)


def _load_tokenizer(model_dir: Path | None):
    path = Path(model_dir) / "tokenizer.json" if model_dir else None
    if path is None or not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


def create_app(settings: AppSettings, backend: Backend | None = None) -> FastAPI:
    """The app over `backend` (default: the one sidecar at settings.endpoint)."""
    backend = backend or SidecarBackend(settings)
    svc = _Service(settings, backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await backend.start()
        try:
            yield
        finally:
            svc.text.close()
            await backend.close()

    app = FastAPI(title="kvhold", lifespan=lifespan)
    app.state.service = svc
    _install_error_handlers(app)
    _install_routes(app, svc)
    app.add_middleware(BodyDeadline, timeout_s=settings.body_timeout_s)   # inside the key check
    _declare_request_models(app, (CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest))
    app.add_middleware(_ApiMiddleware, settings=settings, metrics=backend.metrics)
    return app


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body, or a 413 as soon as it is known to exceed `limit` (by its Content-Length,
    else while it arrives); the server discards the rest and the connection stays usable."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large(int(length), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _request_body(model) -> dict:
    """The OpenAPI declaration of a route's JSON body (the route parses it itself: parse_body)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _declare_request_models(app: FastAPI, models) -> None:
    """Add the request models (and the models they use) to the app's OpenAPI components."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(js.pop("$defs", {}))
                components[model.__name__] = js
        return app.openapi_schema
    app.openapi = openapi


def _install_error_handlers(app: FastAPI) -> None:
    def answer(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), err.status, headers=err.headers())

    @app.exception_handler(ApiError)
    async def on_api_error(request, exc: ApiError):
        return answer(exc)

    @app.exception_handler(KvholdError)
    async def on_sidecar_error(request, exc: KvholdError):
        return answer(api_error_for(exc))

    @app.exception_handler(WireError)
    async def on_wire_error(request, exc: WireError):   # a request the SDK cannot encode
        return answer(api_error_for(exc))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request, exc: RequestValidationError):
        return answer(from_validation_errors(exc.errors()))

    @app.exception_handler(Exception)
    async def on_bug(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return answer(ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return answer(ApiError(exc.status_code, str(exc.detail), type=kind))


def _install_routes(app: FastAPI, svc: _Service) -> None:
    def model_card() -> dict:
        return {"id": svc.settings.served_model_name, "object": "model", "created": svc.created,
                "owned_by": "kvhold", "max_model_len": svc.settings.context_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id != svc.settings.served_model_name:
            raise ApiError(404, f"The model '{model_id}' does not exist", type="not_found_error",
                           param="model", code="model_not_found")
        return model_card()

    @app.get("/version")
    async def version():
        from kvhold import __version__
        return {"version": __version__}

    @app.post("/tokenize", openapi_extra=_request_body(TokenizeRequest))
    async def tokenize(request: Request):
        req = await svc.text.parse(await read_body(request), TokenizeRequest)
        svc.check_model(req.model)
        if req.messages is not None:
            chat = ChatRequest(messages=req.messages, model=req.model)
            ids = await svc.chat_prompt_ids(chat)
        elif req.prompt is not None:
            ids = await svc.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("send 'prompt' or 'messages'", param="prompt",
                              code="missing_required_parameter")
        body = {"tokens": ids, "count": len(ids), "max_model_len": svc.settings.context_len}
        return Response(await svc.text.json(body), media_type="application/json")

    @app.post("/detokenize", openapi_extra=_request_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = await svc.text.parse(await read_body(request), DetokenizeRequest)
        svc.check_model(req.model)
        return {"prompt": await svc.detokenize(req.tokens)}

    @app.post("/v1/completions", openapi_extra=_request_body(CompletionRequest))
    async def completions(request: Request):
        req = await svc.text.parse(await read_body(request), CompletionRequest)
        req.refuse_unsupported()
        svc.check_model(req.model)
        prompts = req.prompt_inputs()
        max_tokens = [svc.max_tokens(req.max_tokens, len(p["prompt_ids"]) if "prompt_ids" in p else None,
                                     default=16) for p in prompts]                # OpenAI's default
        if len(prompts) == 1 and req.n == 1:
            return await svc.serve(req, "completion", prompts[0], max_tokens[0], _owner(request))
        return await svc.serve_choices(req, "completion", prompts, max_tokens)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(ChatRequest))
    async def chat_completions(request: Request):
        req = await svc.text.parse(await read_body(request), ChatRequest)
        req.refuse_unsupported()
        svc.check_model(req.model)
        ids = await svc.chat_prompt_ids(req)
        max_tokens = svc.max_tokens(req.requested_max_tokens, len(ids), default=None,
                                    prompt_param="messages")
        if req.n == 1:
            return await svc.serve(req, "chat", {"prompt_ids": ids}, max_tokens, _owner(request))
        return await svc.serve_choices(req, "chat", [{"prompt_ids": ids}], [max_tokens])

    @app.get("/v1/streams/{stream_id}", openapi_extra=_RESUME_DOC)
    async def resume_stream(stream_id: str, request: Request):
        return await svc.resume(stream_id, request.headers.get("last-event-id"), _owner(request))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: free every idle page of the prefix cache (behind the API key); 200 once the
        active executor has, 400 where the sidecar has none."""
        await svc.backend.reset_prefix_cache()
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        if svc.gate.draining:
            return JSONResponse({"status": "draining", "reason": "shutting down (SIGTERM)"}, 503)
        ok, body = await svc.backend.health()
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/ping")
    async def ping():
        """vLLM's (and SageMaker's) liveness route: /health's answer."""
        return await health()

    @app.post("/ping")
    async def ping_post():
        """/ping by POST, as vLLM also serves it."""
        return await health()

    @app.get("/load")
    async def load():
        """vLLM's server load: the requests this HTTP server is serving now."""
        return {"server_load": sum(1 for g in svc.gate.active if not g.stream.finished)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the tokenizer's configuration (tokenizer_config.json) with the chat template
        this server renders chats with; what lm-eval's remote tokenizer reads."""
        svc._need_tokenizer()
        return svc.tokenizer_info()

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(await svc.backend.render_metrics(), media_type=CONTENT_TYPE_LATEST)
