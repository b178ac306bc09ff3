"""The HTTP server's command-line flags: `kvhold serve` (a sidecar's flags too) and `kvhold router`."""
from __future__ import annotations

import argparse
from pathlib import Path

from kvhold.serving.tool_calls import PARSERS
from kvhold.sidecar.flags import add_log_level_arg, add_registry_args, add_sidecar_args, env


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", type=Path, default=None, metavar="MODEL",
                   help="the checkpoint directory, as `vllm serve MODEL` takes it (the same as --model)")
    add_sidecar_args(p)  # --model also takes "demo": the tiny demo checkpoint, built once
    add_http_args(p)
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template to render chats with, a file or the template itself "
                        "(vLLM's); default: the checkpoint's (chat_template.jinja, or tokenizer_config.json's)")
    p.add_argument("--tool-call-parser", default="auto", choices=("auto", *PARSERS),
                   help="how chat's tool_choice auto reads tool calls in the output (vLLM's flag): "
                        "hermes (Hermes, Qwen: <tool_call>...</tool_call>), llama3_json (Llama 3.x), "
                        "mistral ([TOOL_CALLS]); auto: by the chat template (hermes for kvhold's plain "
                        "one) (default auto)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: kvhold always answers tool_choice auto, "
                        "with --tool-call-parser")
    p.add_argument("--uvicorn-log-level", type=str.lower, default=None,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the HTTP server's uvicorn log level (vLLM's; default: --log-level)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="accepted for vLLM's command lines: kvhold never logs requests' prompts or "
                        "outputs (the access log, --no-access-log, has method, path and status only)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds to wait for the sidecar to serve at start-up (default 300)")
    p.add_argument("--sidecar-endpoint", default=None, metavar="ENDPOINT",
                   help="serve in front of a sidecar that already runs (kvhold sidecar) at this client "
                        "endpoint (ipc://PATH, or tcp://HOST:PORT without CURVE), starting and stopping "
                        "none: its checkpoint, context length and lease apply, and sidecar flags are "
                        "refused; --model is then a local copy of its checkpoint (default: its path)")
    p.add_argument("--http-restart-backoff-s", type=_backoff, default=(0.5, 30.0), metavar="FIRST,MAX",
                   help="the HTTP server is restarted FIRST s after it dies, the delay doubling to at "
                        "most MAX while it keeps dying (a run of 60 s resets it) (default 0.5,30)")
    p.add_argument("--frontend-restart-backoff-s", type=_backoff, default=(0.1, 30.0), metavar="FIRST,MAX",
                   help="the same for the frontend process (default 0.1,30; not with --sidecar-endpoint, "
                        "which runs no frontend)")
    p.add_argument("--sidecar-spare", action=argparse.BooleanOptionalAction, default=True,
                   help="keep a spare memory owner (`kvhold sidecar --spare`) waiting beside the sidecar: "
                        "when the sidecar dies it takes over at once, without a new process's start-up "
                        "(on by default; --no-sidecar-spare restarts the sidecar instead; not with "
                        "--sidecar-endpoint)")


def _backoff(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"FIRST,MAX seconds, got {text!r}")
    first, most = (_seconds(x) for x in parts)
    if first > most:
        raise argparse.ArgumentTypeError(f"FIRST {first} is more than MAX {most}")
    return first, most


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_registry_args(p, ttl=False)
    add_http_args(p)
    p.add_argument("--model", type=Path, default=env("MODEL"),
                   help="a local copy of the served checkpoint, for its tokenizer and chat template "
                        "(without it /v1/chat/completions is unavailable)")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=int, default=None,
                   help="the sidecars' context length, checked here before routing (default: "
                        "min(model context, 4096))")
    add_log_level_arg(p)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in 0..3600 seconds, got {value}")
    return value


def add_http_args(p: argparse.ArgumentParser) -> None:
    from kvhold.serving.http_guards import add_guard_args
    p.add_argument("--host", default=env("HOST", "127.0.0.1"), help="HTTP bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=int(env("PORT", "8000")), help="HTTP port (default %(default)s)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=env("API_KEY"),
                     help="require 'Authorization: Bearer KEY' on /v1 routes and on the API's "
                          "description (/docs, /redoc, /openapi.json) (env KVHOLD_API_KEY); "
                          "/health and /metrics stay open")
    key.add_argument("--api-key-file", type=Path, default=None, help="read the API key from this file")
    p.add_argument("--served-model-name", default=None,
                   help="model id in the API (default: the checkpoint directory's name)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight streams finish (default 30)")
    p.add_argument("--sse-keepalive", type=_seconds, default=10.0, metavar="SECONDS",
                   help="send an SSE comment on a stream silent this long (a failover's pause), so "
                        "that proxies do not close it as idle; 0: never (default %(default)s)")
    p.add_argument("--no-access-log", "--disable-uvicorn-access-log", dest="access_log",
                   action="store_false",
                   help="do not log a line per HTTP request (method, path, status, client), which is "
                        "logged by default at INFO (--disable-uvicorn-access-log: vLLM's name)")
    add_guard_args(p)
