"""OpenAI-compatible request bodies, their validation, and OpenAI-style errors.

Requests are pydantic models that ignore unknown fields (clients send many), but an
option kvhold cannot honour is refused with a 400 naming it rather than silently
ignored: `best_of` above 1, `suffix`, vLLM's extensions at anything but
their neutral value (`length_penalty`, beam search, `include_stop_str_in_output`) and unknown
`stream_options`. vLLM's `prompt_logprobs` k (not streamed, as vLLM's) gives each prompt token
after the first its log-prob, rank and the k most likely tokens there. Structured
output (kvhold.protocol.structured) is one of: `response_format` json_object or json_schema,
vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or its
`structured_outputs` with one of json, regex, choice, grammar, json_object; a spec that does
not compile is a 400 naming the field and the problem. `logit_bias` (token id -> bias in
[-100, 100], OpenAI's) is added to the logits before anything else. Chat's `tools` and
`tool_choice` are read by kvhold.serving.tool_calls. Supported: max_tokens (or
max_completion_tokens), temperature, top_p, seed, stop (strings, applied by the HTTP
layer), log-probs (completions: `logprobs` k and `echo`, with the prompt's log-probs when both
are given; chat: `logprobs` and `top_logprobs`; the sidecar's --max-logprobs bounds k, a larger
one is a 400 naming it; formatted by kvhold.serving.logprobs), and the vLLM-style extensions
top_k, stop_token_ids, ignore_eos, min_tokens (at most the request's max_tokens, else a 400),
and the penalties: presence_penalty and frequency_penalty (OpenAI's, in [-2, 2]), vLLM's
repetition_penalty (> 0, 1 = off) and min_p (in [0, 1]).
Numeric bounds are the protocol's (kvhold.protocol.sampling.LIMITS: what the sidecar accepts
and its journal holds). A body's sampling fields go to the SDK by their SamplingParams names
(`SAMPLING_FIELDS`), which checks them into the request's one record.

Before a body reaches its model it must be at most MAX_BODY_BYTES (else 413), parse as JSON
(nesting at most MAX_JSON_DEPTH deep) and hold only valid Unicode strings (no lone
surrogate); each failure is a 4xx naming what is wrong, never a 500.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import json

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from kvhold.protocol import structured as structured_output
from kvhold.protocol.errors import ErrorCode, InvalidParams
from kvhold.protocol.layout import MAX_STOP_IDS
from kvhold.protocol.sampling import LIMITS, TOKEN_ID_MAX, check_text, show
from kvhold.protocol.structured import ANY_OBJECT
from kvhold.serving.tool_calls import ToolMode, named_schema, required_schema
from kvhold.protocol.wire import MAX_FRAME_BYTES, WireError

MAX_BODY_BYTES = MAX_FRAME_BYTES        # a larger request could not reach the sidecar in one frame
MAX_JSON_DEPTH = 32
TokenId = Annotated[int, Field(ge=0, le=TOKEN_ID_MAX)]


RETRY_AFTER_S = 1         # the Retry-After of a 429 or 503: a pool restart or takeover takes seconds


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str] | None:
        """A refusal for now (429 overloaded, 503 unavailable: a pool restart, a takeover of the
        memory owner, a drain) tells the client when to try again; OpenAI's SDKs honour it."""
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status in (429, 503) else None


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


def too_large(size: int | None, limit: int = MAX_BODY_BYTES) -> ApiError:
    what = f"of {size} bytes " if size is not None else ""
    return ApiError(413, f"The request body {what}exceeds the limit of {limit} bytes.",
                    code="request_too_large")


def parse_body(raw: bytes, model: type[BaseModel]):
    """Request bytes -> a validated request model, or a 400 (whatever the content type)."""
    if len(raw) > MAX_BODY_BYTES:
        raise too_large(len(raw))
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, huge integers
        detail = exc if isinstance(exc, ValueError) else "nested too deeply"
        raise bad_request(f"We could not parse the JSON body of your request: {str(detail)[:200]}",
                          code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    _check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None


def _check_json(data) -> None:
    """Nesting depth and valid Unicode in every string of a parsed body (iteratively: no depth
    can exhaust the stack); a 400 naming the first offending parameter."""
    stack = [(data, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            try:
                check_text(value, "the string")
            except ValueError as exc:
                param = ".".join(map(str, path)) or None
                raise bad_request(f"Invalid value for '{param}': {exc}", param=param,
                                  code="invalid_value") from None
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"The JSON body of your request is nested more than {MAX_JSON_DEPTH} "
                              "levels deep.", code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                stack.append((key, path, depth))
            if isinstance(item, (str, dict, list)):      # numbers, booleans, null: nothing to check
                stack.append((item, path + (key,), depth + 1))


NEUTRAL_EXTENSIONS = {"length_penalty": 1.0,
                      "use_beam_search": False, "include_stop_str_in_output": False}
# vLLM's guided decoding fields (and the keys of its `structured_outputs`) -> kvhold's kinds
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
MAX_CHOICES = 64            # prompts times n in one request
# the body's fields that are SamplingParams fields of the same name, passed on as given (unless
# None); max_tokens and the log-probs are the endpoint's own (`sampling`, `logprob_params`)
SAMPLING_FIELDS = ("temperature", "top_p", "seed", "top_k", "stop_token_ids", "ignore_eos", "min_tokens",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    _structured_checked: bool = PrivateAttr(default=False)
    _structured_pair: Any = PrivateAttr(default=None)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=LIMITS["seed"].lo, le=LIMITS["seed"].hi)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: dict | None = None
    n: int = Field(1, ge=1)
    presence_penalty: float = Field(0.0, ge=LIMITS["presence_penalty"].lo, le=LIMITS["presence_penalty"].hi)
    frequency_penalty: float = Field(0.0, ge=LIMITS["frequency_penalty"].lo, le=LIMITS["frequency_penalty"].hi)
    logit_bias: dict | None = None
    user: str | None = None
    # vLLM-style extensions backed by kvhold's sampling parameters
    top_k: int | None = Field(None, ge=LIMITS["top_k"].lo, le=LIMITS["top_k"].hi)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=LIMITS["min_tokens"].lo, le=LIMITS["min_tokens"].hi)
    repetition_penalty: float = Field(1.0, gt=LIMITS["repetition_penalty"].lo, le=LIMITS["repetition_penalty"].hi)
    min_p: float = Field(0.0, ge=LIMITS["min_p"].lo, le=LIMITS["min_p"].hi)
    # vLLM-style extensions kvhold does not implement: refused unless at their neutral value
    length_penalty: float = 1.0
    use_beam_search: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: each prompt token's log-prob, rank and the k most likely there (not streamed)
    prompt_logprobs: int | None = Field(None, ge=0, le=LIMITS["prompt_logprobs"].hi)
    # structured output (kvhold.protocol.structured): OpenAI's response_format, vLLM's guided_*
    # fields and its structured_outputs; at most one of them
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict | None = None

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
        if self.n > MAX_CHOICES:
            raise bad_request(f"n is at most {MAX_CHOICES}", param="n", code="invalid_value")
        try:
            structured_output.check_logit_bias(self.logit_bias)
        except InvalidParams as exc:
            raise bad_request(str(exc), param="logit_bias", code="invalid_value") from None
        for name, neutral in NEUTRAL_EXTENSIONS.items():
            if getattr(self, name) != neutral:
                raise bad_request(f"{name} is not supported (only {neutral!r}, which changes nothing)",
                                  param=name, code="unsupported_value")
        unknown = sorted(set(self.stream_options or {}) - STREAM_OPTIONS)
        if unknown:
            raise bad_request(f"stream_options.{unknown[0]} is not supported (supported: "
                              f"{', '.join(sorted(STREAM_OPTIONS))})", param="stream_options",
                              code="unsupported_value")
        if self.stream_options and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs are not available with stream: true (as vLLM's)",
                              param="prompt_logprobs", code="invalid_value")
        self.structured()

    def structured(self) -> tuple[str, str] | None:
        """The (kind, spec) of structured output the body asks for, checked (it compiles), or
        None; a 400 naming the field for a spec that does not compile, or for two at once.
        Compiled once per request body, however many choices it has."""
        if not self._structured_checked:
            self._structured_pair = self._structured()
            self._structured_checked = True
        return self._structured_pair

    def _structured(self) -> tuple[str, str] | None:
        asked = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind == "json_object":
                asked.append(("response_format", ("json", ANY_OBJECT)))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format json_schema needs json_schema.schema, a JSON "
                                      "schema object", param="response_format", code="invalid_value")
                asked.append(("response_format", ("json", json.dumps(schema))))
            elif kind != "text":
                raise bad_request(f"response_format type {str(kind)[:40]!r} is not supported (text, "
                                  f"json_object, json_schema)", param="response_format", code="unsupported_value")
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                asked.append((name, (kind, _spec_text(kind, value, name))))
        so = self.structured_outputs
        if so is not None:
            keys = [k for k, v in so.items() if v not in (None, False)] if isinstance(so, dict) else None
            if keys is None or len(keys) != 1 or (keys[0] not in STRUCTURED_OUTPUTS and keys[0] != "json_object"):
                raise bad_request(f"structured_outputs must set exactly one of "
                                  f"{', '.join([*STRUCTURED_OUTPUTS, 'json_object'])}",
                                  param="structured_outputs", code="invalid_value")
            key = keys[0]
            asked.append(("structured_outputs", ("json", ANY_OBJECT) if key == "json_object" else
                          (STRUCTURED_OUTPUTS[key], _spec_text(STRUCTURED_OUTPUTS[key], so[key],
                                                               f"structured_outputs.{key}"))))
        if len(asked) > 1:
            raise bad_request(f"ask for one structured output, not {asked[0][0]} and {asked[1][0]}",
                              param=asked[1][0], code="invalid_value")
        if not asked:
            return None
        param, pair = asked[0]
        try:
            structured_output.check(pair)
        except InvalidParams as exc:
            raise bad_request(str(exc), param=param, code="invalid_value") from None
        return pair

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: the usage so far on every chunk."""
        return bool(self.stream_options and self.stream_options.get("continuous_usage_stats"))

    def logprob_params(self) -> dict:
        """The log-probs asked for, as SamplingParams fields (none by default)."""
        return {}

    def sampling(self, max_tokens: int, choice: int = 0) -> dict:
        """Keyword arguments for AsyncClient.generate (kvhold.protocol.sampling.SamplingParams);
        choice j of n > 1 samples with seed + j (its own draws, reproducible across a recovery)."""
        if self.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({max_tokens})",
                              param="min_tokens", code="invalid_value")
        out: dict[str, Any] = {name: getattr(self, name) for name in SAMPLING_FIELDS
                               if getattr(self, name) is not None}
        out["max_tokens"] = max(1, max_tokens)     # 0 (score only): one token generated, then dropped
        structured = self.structured()
        if structured is not None:
            out["structured"] = list(structured)
        if self.logit_bias:
            out["logit_bias"] = self.logit_bias
        if choice and self.seed is not None:
            out["seed"] = (self.seed + choice) % (LIMITS["seed"].hi + 1)
        out.update(self.logprob_params())
        return out


def _spec_text(kind: str, value, param: str) -> str:
    """A guided field's value as the spec's text: a JSON schema or a list of choices may come as
    JSON values, a regex and a grammar as strings."""
    if kind in ("json", "choice") and not isinstance(value, str):
        if kind == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
            raise bad_request(f"{param} must be a list of strings", param=param, code="invalid_value")
        return json.dumps(value)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param=param, code="invalid_value")
    return value


def _check_ids(v: list) -> list:
    bad = next((x for x in v if not 0 <= x <= TOKEN_ID_MAX), None)
    if bad is not None:
        raise ValueError(f"token ids must be integers in [0, {TOKEN_ID_MAX}], got {show(bad)}")
    return v


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    max_tokens: int | None = Field(None, ge=0)          # 0 with echo: the prompt scored, nothing generated
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=LIMITS["logprobs"].hi)
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        """One error naming `prompt` (not each member of its union) for a prompt of no shape."""
        if isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            return v
        if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return _check_ids(v)
        if isinstance(v, list) and v and all(isinstance(x, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x) for x in v):
            return [_check_ids(x) for x in v]
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of "
                         "lists of token ids")

    @property
    def score_only(self) -> bool:
        """`echo` with `max_tokens: 0` (vLLM's): the prompt (and with `logprobs`, its
        log-probs) scored, nothing generated."""
        return self.echo and self.max_tokens == 0

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise bad_request("max_tokens 0 generates nothing: it needs echo (the prompt scored)",
                              param="max_tokens", code="invalid_value")
        if self.echo and None not in (self.logprobs, self.prompt_logprobs) and self.logprobs != self.prompt_logprobs:
            raise bad_request("echo with logprobs gives the prompt's log-probs with logprobs' k: "
                              "prompt_logprobs, if given too, must be the same k", param="prompt_logprobs",
                              code="invalid_value")
        for name, ok in (("suffix", not self.suffix), ("best_of", self.best_of in (None, 1))):
            if not ok:
                raise bad_request(f"{name} is not supported", param=name, code="unsupported_value")

    def logprob_params(self) -> dict:
        """logprobs k: each token's log-prob and the k most likely; with echo, the prompt's too;
        vLLM's prompt_logprobs k: the prompt's (echo's k is then the larger of the two)."""
        out = {} if self.logprobs is None else {"logprobs": self.logprobs}
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return {**out, "prompt_logprobs": max(ks)} if ks else out

    def prompt_inputs(self) -> list[dict]:
        """Each prompt as {'prompt': str} or {'prompt_ids': [...]}: one, or a batch (a list of
        strings or of token-id lists), each answered as its own choices."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            batch = [p]
        else:
            batch = list(p)
        if not batch:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(batch) * self.n > MAX_CHOICES:
            raise bad_request(f"a request has at most {MAX_CHOICES} choices (prompts times n)",
                              param="prompt", code="invalid_value")
        out = []
        for one in batch:
            if not one:
                raise bad_request("prompt must not be empty", param="prompt")
            out.append({"prompt": one} if isinstance(one, str) else {"prompt_ids": list(one)})
        return out


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict], None] = None
    name: str | None = None
    tool_calls: list[dict] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None            # a tool message: the call it answers

    def for_template(self) -> dict:
        """The message as a chat template sees it (transformers' form): text content, and an
        assistant's tool calls with their arguments as objects, as vLLM passes them."""
        out = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request("each tool call needs function.name", param="messages", code="invalid_value")
                args = fn.get("arguments", "{}")
                if isinstance(args, str):
                    try:
                        args = json.loads(args or "{}")
                    except ValueError:
                        raise bad_request(f"the arguments of tool call {fn['name']!r} are not JSON",
                                          param="messages", code="invalid_value") from None
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": args}})
            out["tool_calls"] = calls
        return out

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
    top_logprobs: int | None = Field(None, ge=0, le=LIMITS["logprobs"].hi)
    tools: list[dict] | None = None
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: bool = True

    def tool_mode(self, parser: str) -> ToolMode:
        """What the output is for tools (kvhold.serving.tool_calls), checked: a 400 naming the
        field for tools of no shape, a choice of none of them, or one without tools."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools", param="tool_choice", code="invalid_value")
            return ToolMode("none")
        names = []
        for t in self.tools:
            fn = t.get("function") if t.get("type", "function") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise bad_request("each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                                  "\"parameters\": {...}}}", param="tools", code="invalid_value")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise bad_request(f"the parameters of tool {fn['name']!r} must be a JSON schema object",
                                  param="tools", code="invalid_value")
            names.append(fn["name"])
        if choice is None or choice == "auto":
            return ToolMode("auto", parser=parser, parallel=self.parallel_tool_calls)
        if choice in ("none", "required"):
            return ToolMode(choice, parallel=self.parallel_tool_calls)
        fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        if not isinstance(fn, dict) or fn.get("name") not in names:
            raise bad_request(f"tool_choice must be none, auto, required or {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": one of {names}}}}}", param="tool_choice",
                              code="invalid_value")
        return ToolMode("named", fn["name"])

    def _structured(self) -> tuple[str, str] | None:
        """With tool_choice required or a named function, the output's grammar (a JSON schema
        of the calls); otherwise the body's structured output, if any."""
        mode = self.tool_mode("hermes")
        if mode.mode in ("required", "named"):
            if super()._structured() is not None:
                raise bad_request("tool_choice required or a named function fixes the output's form: "
                                  "it cannot be combined with structured output", param="tool_choice",
                                  code="invalid_value")
            schema = (required_schema(self.tools, self.parallel_tool_calls) if mode.mode == "required"
                      else named_schema(self.tools, mode.name))
            pair = ("json", json.dumps(schema))
            try:
                structured_output.check(pair)
            except InvalidParams as exc:
                raise bad_request(f"the tools' parameters: {exc}", param="tools", code="invalid_value") from None
            return pair
        return super()._structured()

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs",
                              code="invalid_value")

    def logprob_params(self) -> dict:
        out = {"logprobs": self.top_logprobs or 0} if self.logprobs else {}
        return {**out, "prompt_logprobs": self.prompt_logprobs} if self.prompt_logprobs is not None else out

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM's: a prompt, or chat messages through the chat template."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_BODY_BYTES)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM's."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[TokenId] = Field(..., max_length=1 << 20)


def api_error_for(exc: Exception) -> ApiError:
    """The HTTP answer for an error raised while talking to the sidecar."""
    from kvhold.protocol import errors as e

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, e.PromptTooLarge):
        return ApiError(413, str(exc), param="prompt", code="prompt_too_large")
    if getattr(exc, "code", None) == ErrorCode.TOO_LARGE:    # a WireError or the sidecar's refusal
        return ApiError(413, f"The request is too large: {exc}", code="request_too_large")
    if isinstance(exc, WireError):
        return bad_request(f"The request cannot be sent to the model: {exc}", code="invalid_value")
    if isinstance(exc, e.PromptTooLong):
        return bad_request(str(exc), param="max_tokens", code="context_length_exceeded")
    if isinstance(exc, e.InvalidParams):
        return bad_request(str(exc), code="invalid_value")
    if isinstance(exc, e.NotFound):
        return ApiError(404, str(exc), type="not_found_error", code="not_found")
    if isinstance(exc, e.RequestFailed):     # the request crashes the engine: its own fault
        return ApiError(422, str(exc), type="invalid_request_error", code="request_crashed_engine")
    if isinstance(exc, e.Overloaded):
        return ApiError(429, str(exc), type="overloaded", code="overloaded")
    if isinstance(exc, (e.SidecarUnavailable, e.ShuttingDown)):
        return ApiError(503, f"the model is unavailable: {exc}", type="service_unavailable",
                        code="unavailable")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
