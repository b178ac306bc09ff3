"""`kvhold router`: the OpenAI-compatible HTTP API of kvhold.serving.http_api over a registry's sidecars.

No sidecar runs here: requests go, through kvhold.routing.arouter.AsyncRoutedClient, to the least loaded
serving sidecar registered in etcd under --service; one marked drain (or starting) is avoided;
a stream whose sidecar dies or whose lease expires moves to another sidecar with the tokens
already sent, and the HTTP client sees only a pause. /health is 200 while at least one
registered sidecar serves; /metrics counts HTTP requests, requests routed per sidecar and
moves per sidecar lost. SIGTERM drains as in `kvhold serve`.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvhold.protocol.sampling import RequestInput
from kvhold.routing.arouter import AsyncRoutedClient, AsyncRoutedStream
from kvhold.routing.registry_client import HEALTH, EtcdGateway, RegistryView, validate_service
from kvhold.serving.http_guards import HttpGuards
from kvhold.serving.metrics import RECOVERY_BUCKETS, RequestMetrics

log = logging.getLogger(__name__)
DEFAULT_CONTEXT = 4096


@dataclass(frozen=True, slots=True)
class RouterConfig:
    registry: str
    service: str
    host: str
    port: int
    api_key: str | None
    model: Path | None             # a local copy of the checkpoint: tokenizer, chat template
    served_model_name: str | None  # default: the model directory's name (as sidecars register it)
    context_len: int
    drain_timeout_s: float = 30.0
    log_level: str = "INFO"
    access_log: bool = True
    sse_keepalive_s: float = 10.0
    guards: HttpGuards = HttpGuards()


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.serving.serve import http_flags_from_args

    if not args.registry:
        raise ValueError("--registry etcd://HOST:PORT is required (or KVHOLD_REGISTRY)")
    validate_service(args.service)
    api_key = http_flags_from_args(args)
    model = Path(args.model) if args.model else None
    context = args.max_seq_len or (min(ModelSpec.from_dir(model).max_position, DEFAULT_CONTEXT)
                                   if model else DEFAULT_CONTEXT)
    return RouterConfig(registry=args.registry, service=args.service, host=args.host, port=args.port,
                        api_key=api_key, model=model,
                        served_model_name=args.served_model_name or (model.name if model else None),
                        context_len=context, drain_timeout_s=args.drain_timeout, log_level=args.log_level,
                        access_log=args.access_log, sse_keepalive_s=args.sse_keepalive,
                        guards=HttpGuards.from_args(args))


class RouterMetrics:
    """The router's own series; sidecar internals are each sidecar's /metrics."""

    def __init__(self, model_name: str = ""):
        self.registry = r = CollectorRegistry()
        self.requests = RequestMetrics(r, model_name)
        self.http = Counter("kvhold_http_requests", "HTTP API requests", ["endpoint", "code"], registry=r)
        self.ttft = Histogram("kvhold_http_time_to_first_token_seconds", "Request received to first "
                              "token", ["endpoint"], buckets=RECOVERY_BUCKETS, registry=r)
        self.backend: RouterBackend | None = None
        r.register(self)

    def collect(self):
        b = self.backend
        if b is None or b.client is None:
            return
        routed = CounterMetricFamily("kvhold_router_requests_routed", "Requests (and moved "
                                     "continuations) placed on each sidecar", labels=["sidecar"])
        for key, n in sorted(b.client.routed.items()):
            routed.add_metric([key.rsplit("/", 1)[-1]], n)
        moves = CounterMetricFamily("kvhold_router_moves", "Streams moved off a lost sidecar",
                                    labels=["sidecar"])
        for key, n in sorted(b.client.moved.items()):
            moves.add_metric([key.rsplit("/", 1)[-1]], n)
        sidecars = GaugeMetricFamily("kvhold_router_sidecars", "Registered sidecars by health",
                                     labels=["health"])
        entries = b.view.entries()
        for health in HEALTH:
            sidecars.add_metric([health], sum(e.health == health for e in entries))
        yield routed
        yield moves
        yield sidecars
        yield GaugeMetricFamily("kvhold_router_registry_connected", "1 while etcd answers",
                                value=int(b.view.connected))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe_request(self, **request) -> None:
        self.requests.observe(**request)

    def observe_choices(self, n: int) -> None:
        self.requests.params_n.labels(self.requests.model_name).observe(n)

    def observe_choices_ended(self, generated: list[int]) -> None:
        self.requests.max_generation.labels(self.requests.model_name).observe(max(generated, default=0))


class RouterBackend:
    """http_api's backend (kvhold.serving.backend.Backend) over a registry view: submit routes,
    health counts serving sidecars. Its streams are not resumed after an HTTP server restart."""
    resumes_streams = False

    def __init__(self, view: RegistryView, model_name: str = ""):
        self.view = view
        self.metrics = RouterMetrics(model_name)
        self.metrics.backend = self
        self.client: AsyncRoutedClient | None = None

    async def start(self) -> None:
        self.client = AsyncRoutedClient(self.view)

    async def close(self) -> None:
        await self.client.close()

    async def submit(self, request: RequestInput) -> AsyncRoutedStream:
        return await self.client.submit(request)

    async def attach(self, request_id: int):
        raise NotImplementedError("kvhold router does not take streams up again")

    async def health(self) -> tuple[bool, dict]:
        serving, entries = self.client.serving(), self.view.entries()
        body = {"status": "ok" if serving else "unavailable", "sidecars_serving": len(serving),
                "sidecars_registered": len(entries), "registry_connected": self.view.connected,
                "in_flight": sum(e.in_flight for e in entries),
                "reason": f"{len(serving)} serving sidecar(s) registered" if serving
                else "no serving sidecar registered"}
        return bool(serving), body

    async def render_metrics(self) -> bytes:
        return self.metrics.render()

    async def reset_prefix_cache(self) -> None:
        from kvhold.serving.openai_schema import ApiError

        raise ApiError(400, "kvhold router does not reset its sidecars' prefix caches: send POST "
                            "/reset_prefix_cache to each sidecar's kvhold serve", code="unsupported")


def run_router(config: RouterConfig) -> int:
    import uvicorn

    from kvhold.serving.http_api import AppSettings, create_app
    from kvhold.serving.serve import DrainingServer

    view = RegistryView(EtcdGateway.from_url(config.registry), config.service).start()
    try:
        name = config.served_model_name or next((e.model for e in view.entries()), "default")
        app = create_app(AppSettings(endpoint="", model_dir=config.model, served_model_name=name,
                                     context_len=config.context_len, api_key=config.api_key,
                                     body_timeout_s=config.guards.body_timeout_s,
                                     sse_keepalive_s=config.sse_keepalive_s),
                         backend=RouterBackend(view, name))
        server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port,
                                               log_level=config.log_level.lower(), access_log=config.access_log,
                                               timeout_graceful_shutdown=5,
                                               **config.guards.uvicorn_options()),
                                app.state.service.gate, config.drain_timeout_s)
        log.info("routing %r on http://%s:%d to service %r at %s", name, config.host, config.port,
                 config.service, config.registry)
        server.run()
        return server.exit_code
    finally:
        view.stop()
        log.info("stopped")
