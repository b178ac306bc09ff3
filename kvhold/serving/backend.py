"""What the HTTP API (kvhold.serving.http_api) needs from what it serves over.

A `Backend` is one local sidecar (`http_api.SidecarBackend`, over the asyncio SDK) or the
sidecars of a registry (`router_http.RouterBackend`, over kvhold.routing.arouter); the
API's code asks nothing else of them. A request it sends is checked already
(kvhold.protocol.sampling.RequestInput) and comes back as a `TokenStream`: the SDK's
AsyncStream, or a routed stream that moves between sidecars.
"""
from __future__ import annotations

from typing import Protocol

from kvhold.client.core import GenerationResult, TokenEvent, TokenLogprob
from kvhold.protocol.sampling import RequestInput


class TokenStream(Protocol):
    """One request's tokens, then its result."""

    @property
    def request_id(self) -> int:
        """What names it in the API's answers (response ids, event ids)."""

    @property
    def prompt_tokens(self) -> int:
        """0 until known (a stream taken up again learns it from its result)."""

    @property
    def finished(self) -> bool: ...

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None: ...

    def __aiter__(self) -> "TokenStream": ...

    async def __anext__(self) -> TokenEvent: ...

    async def result(self) -> GenerationResult: ...

    async def cancel(self) -> None: ...


class BackendMetrics(Protocol):
    """The Prometheus series the API updates (kvhold.serving.metrics.SidecarMetrics, or the
    router's): HTTP requests by endpoint and code, time to first token, each request's end."""
    http: object
    ttft: object

    def observe_request(self, **request) -> None: ...

    def observe_choices(self, n: int) -> None: ...

    def observe_choices_ended(self, generated: list[int]) -> None: ...


class Backend(Protocol):
    metrics: BackendMetrics
    resumes_streams: bool         # `attach` takes a stream up again (GET /v1/streams/{id})

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(self, request: RequestInput) -> TokenStream: ...

    async def attach(self, request_id: int) -> TokenStream:
        """The stream of a request started before this server's restart (see
        kvhold.serving.stream_resume); only where `resumes_streams`."""
        ...

    async def health(self) -> tuple[bool, dict]: ...

    async def render_metrics(self) -> bytes: ...

    async def reset_prefix_cache(self) -> None:
        """Free every idle page of the prefix cache (POST /reset_prefix_cache)."""
        ...
