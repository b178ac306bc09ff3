"""OpenAI-compatible request bodies, their validation, and OpenAI-style errors.

Requests are pydantic models that ignore unknown fields (clients send many), but an
option kvhold cannot honour is refused with a 400 naming it rather than silently
ignored: `n`/`best_of` above 1, `logprobs`, non-zero penalties, `logit_bias`, `echo`,
`suffix`, tools and non-text response formats. Supported: max_tokens (or
max_completion_tokens), temperature, top_p, seed, stop (strings, applied by the HTTP
layer), and the vLLM-style extensions top_k, stop_token_ids, ignore_eos.
"""
from __future__ import annotations

from typing import Any, Literal, Union

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def from_validation_errors(errors: list[dict]) -> ApiError:
    """The first pydantic/FastAPI validation error as a 400."""
    err = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if err.get("type") == "json_invalid":
        return bad_request(f"We could not parse the JSON body of your request: {err.get('msg')}",
                           code="invalid_json")
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "missing" and param is None:
        return bad_request("The request body is missing: send a JSON object.", code="invalid_json")
    if err.get("type") == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    where = f"'{param}': " if param else ""
    return bad_request(f"Invalid value for {where}{err.get('msg', 'invalid')}", param=param,
                       code="invalid_value")


def parse_body(raw: bytes, model: type[BaseModel]):
    """Request bytes -> a validated request model, or a 400 (whatever the content type)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}",
                          code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    user: str | None = None
    # vLLM-style extensions backed by kvhold's sampling parameters
    top_k: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise bad_request("n > 1 is not supported: send one request per choice", param="n",
                              code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported", param=name, code="unsupported_value")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias",
                              code="unsupported_value")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def sampling(self, max_tokens: int) -> dict:
        """Keyword arguments for AsyncClient.generate (kvhold.protocol.sampling.SamplingParams)."""
        out: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "seed", "top_k"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name, ok in (("echo", not self.echo), ("suffix", not self.suffix),
                         ("logprobs", self.logprobs is None), ("best_of", self.best_of in (None, 1))):
            if not ok:
                raise bad_request(f"{name} is not supported", param=name, code="unsupported_value")

    def prompt_input(self) -> dict:
        """{'prompt': str} or {'prompt_ids': [...]}; one prompt per request."""
        p = self.prompt
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            if len(p) != 1:
                raise bad_request("batched prompts are not supported: send one prompt per request",
                                  param="prompt", code="unsupported_value")
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise bad_request("prompt must not be empty", param="prompt")
            return {"prompt": p}
        if not p:
            raise bad_request("prompt must not be empty", param="prompt")
        return {"prompt_ids": list(p)}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    name: str | None = None

    def text(self) -> str:
        """The content as text; list content may hold only text parts."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise bad_request(f"content parts of type {part.get('type')!r} are not supported",
                                  param="messages", code="unsupported_value")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    tools: list | None = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs:
            raise bad_request("logprobs is not supported", param="logprobs", code="unsupported_value")
        if self.tools:
            raise bad_request("tools are not supported", param="tools", code="unsupported_value")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only the text response_format is supported", param="response_format",
                              code="unsupported_value")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def api_error_for(exc: Exception) -> ApiError:
    """The HTTP answer for an error raised while talking to the sidecar."""
    from kvhold.protocol import errors as e

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, e.PromptTooLarge):
        return ApiError(413, str(exc), param="prompt", code="prompt_too_large")
    if isinstance(exc, e.PromptTooLong):
        return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, e.InvalidParams):
        return bad_request(str(exc), code="invalid_value")
    if isinstance(exc, e.RequestFailed):     # the request crashes the engine: its own fault
        return ApiError(422, str(exc), type="invalid_request_error", code="request_crashed_engine")
    if isinstance(exc, e.Overloaded):
        return ApiError(429, str(exc), type="overloaded", code="overloaded")
    if isinstance(exc, (e.SidecarUnavailable, e.ShuttingDown)):
        return ApiError(503, f"the model is unavailable: {exc}", type="service_unavailable",
                        code="unavailable")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
