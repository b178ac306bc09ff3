"""Tool calls: OpenAI's `tools` and `tool_choice` on a chat request, and the calls in its output.

How a request's output becomes tool calls depends on `tool_choice`:

    none        plain content (the tools are still shown to the model by the chat template)
    named       {"type": "function", "function": {"name": N}}: the output is constrained by
                the function's parameters schema (structured output) and is its arguments;
                finish reason `stop`, as OpenAI's
    required    the output is constrained to a JSON array of at least one
                {"name": ..., "parameters": {...}} of the tools (vLLM's form); finish `tool_calls`
    auto        (the default when tools are given) free text, read by the model family's parser:
                `hermes` (Hermes, Qwen: <tool_call>{"name", "arguments"}</tool_call>, also
                kvhold's plain template), `llama3_json` (Llama 3.x: a JSON object
                {"name", "parameters"} as the whole output, optionally after <|python_tag|>,
                several separated by ";"), `mistral` ([TOOL_CALLS] then a JSON list of
                {"name", "arguments"}); finish `tool_calls` when it found any

Named and required calls are structured output (kvhold.protocol.structured), so they continue
token for token across an executor crash like any constrained request; auto is parsed from the
text, which is itself exact across a crash. Streamed, content is sent as it comes until the
parser's marker could be starting; from there the text is held and, at the end, the calls go
out as tool-call deltas (one per call, the whole arguments at once), which OpenAI's SDKs and
agent frameworks accumulate as they do OpenAI's own. A call's id is derived from the response's
id and its index, so a stream taken up again (Last-Event-ID) sends the same ids.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral")
MODES = ("none", "auto", "required", "named")


@dataclass
class ToolCall:
    name: str
    arguments: str       # JSON text


@dataclass(frozen=True)
class ToolMode:
    """What a request's output is, for tools: `mode` one of MODES, `name` the named function,
    `parser` the auto mode's (one of PARSERS); without `parallel` (parallel_tool_calls false)
    at most one call."""
    mode: str
    name: str | None = None
    parser: str = "hermes"
    parallel: bool = True

    def to_record(self) -> dict:
        return {"mode": self.mode, "name": self.name, "parser": self.parser, "parallel": self.parallel}

    @classmethod
    def from_record(cls, d: dict | None) -> "ToolMode | None":
        return cls(d["mode"], d.get("name"), d.get("parser", "hermes"), d.get("parallel", True)) if d else None


def parser_for_template(source: str) -> str:
    """The parser of the family a chat template belongs to (what it tells the model to emit)."""
    if "[TOOL_CALLS]" in source:
        return "mistral"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return "hermes"                 # Hermes and Qwen templates, and kvhold's plain one


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema of tool_choice required: an array of at least one call of the tools (of
    exactly one without `parallel`). Each tool's own definitions ($defs, definitions) move to
    the top, renamed per tool, and its references follow them."""
    defs, calls = {}, []
    for i, t in enumerate(tools):
        params = dict(t["function"].get("parameters") or {"type": "object"})
        renames = {}
        for key in ("$defs", "definitions"):
            for name, schema in (params.pop(key, None) or {}).items():
                renames[f"#/{key}/{name}"] = f"#/$defs/t{i}_{name}"
                defs[f"t{i}_{name}"] = schema
        calls.append({"type": "object", "properties": {"name": {"enum": [t["function"]["name"]]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
        if renames:
            calls[-1] = _rename_refs(calls[-1], renames)
            for name in [n for n in defs if n.startswith(f"t{i}_")]:
                defs[name] = _rename_refs(defs[name], renames)
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _rename_refs(node, renames: dict):
    if isinstance(node, dict):
        return {k: (renames.get(v, v) if k == "$ref" and isinstance(v, str) else _rename_refs(v, renames))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rename_refs(v, renames) for v in node]
    return node


def named_schema(tools: list[dict], name: str) -> dict:
    fn = next(t["function"] for t in tools if t["function"]["name"] == name)
    return fn.get("parameters") or {"type": "object"}


def call_id(response_id: str, index: int) -> str:
    return "call_" + hashlib.sha256(f"{response_id}:{index}".encode()).hexdigest()[:24]


# ---------------------------------------------------------------- parsers: text -> (content, calls)

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _call(obj, args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES.findall(text[start:]):
        try:
            call = _call(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return text, []          # not a well-formed call: the text stays content
        calls.append(call)
    return text[:start], calls


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return text, []
    calls, decoder, i = [], json.JSONDecoder(), 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call(obj, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return "", calls


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    try:
        items = json.loads(text[start + len("[TOOL_CALLS]"):].strip())
    except ValueError:
        return text, []
    items = items if isinstance(items, list) else [items]
    calls = [_call(obj, "arguments") for obj in items]
    if not calls or any(c is None for c in calls):
        return text, []
    return text[:start], calls


PARSE = {"hermes": parse_hermes, "llama3_json": parse_llama3_json, "mistral": parse_mistral}
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a tool_choice required output (its grammar makes it a JSON array of calls)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []
    calls = [_call(obj, "parameters") for obj in items] if isinstance(items, list) else []
    return [c for c in calls if c is not None]


@dataclass
class ToolOutput:
    """One choice's output under a ToolMode: `push` each text piece and send what it returns as
    content now; `finish` gives the rest of the content and the calls."""
    tool: ToolMode
    _held: str = ""
    _holding: bool = False
    _text: list[str] = field(default_factory=list)

    def push(self, piece: str) -> str:
        self._text.append(piece)
        mode = self.tool.mode
        if mode == "none":
            return piece
        if mode in ("named", "required") or self._holding:
            self._held += piece
            return ""
        buf = self._held + piece
        if self.tool.parser == "llama3_json":
            stripped, tag = buf.lstrip(), "<|python_tag|>"
            if stripped.startswith("{") or stripped.startswith(tag):
                self._holding, self._held = True, buf
                return ""
            if not stripped or tag.startswith(stripped):      # undecided yet
                self._held = buf
                return ""
            self.tool = ToolMode("none")     # plain text: a call comes only at the start
            self._held = ""
            return buf
        marker = MARKERS[self.tool.parser]
        at = buf.find(marker)
        if at >= 0:
            self._holding, self._held = True, buf[at:]
            return buf[:at]
        keep = next((n for n in range(min(len(marker) - 1, len(buf)), 0, -1) if buf.endswith(marker[:n])), 0)
        self._held = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet sent, the calls)."""
        held, self._held = self._held, ""
        mode = self.tool.mode
        if mode == "none":
            return held, []
        if mode == "named":
            return "", [ToolCall(self.tool.name, held)]
        if mode == "required":
            calls = parse_required(held)
            return ("" if calls else held), calls        # cut short (length): the text, as content
        content, calls = PARSE[self.tool.parser](held)
        if calls and not self.tool.parallel:
            calls = calls[:1]                            # parallel_tool_calls false: the first
        return (content if calls else held), calls

    def finish_reason(self, calls: list[ToolCall], reason: str) -> str:
        """OpenAI's finish reason: `tool_calls` when auto or required produced calls."""
        return "tool_calls" if calls and self.tool.mode in ("auto", "required") and reason == "stop" else reason
