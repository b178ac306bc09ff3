"""Chat messages -> prompt text, as Hugging Face's `apply_chat_template` does.

The template is found where transformers looks, in its order: template files first
(`chat_template.jinja`, the default one, which transformers 5 writes next to
tokenizer_config.json, and named ones under `additional_chat_templates/`), and only
when there is none, the `chat_template` of `tokenizer_config.json` (a string, or a list
of named templates). Of named templates "default" is used (else the first listed).
The one chosen is logged with where it came from. It is rendered in a sandboxed Jinja
environment with `messages`, `bos_token`, `eos_token`, `add_generation_prompt=True`, `tools`
and `raise_exception`, like transformers. A checkpoint without any gets the documented plain
template below, with a warning. The text is tokenized with no special tokens added: the
template writes the BOS token itself.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when the checkpoint defines no chat template:
#   <bos>system: ...\nuser: ...\nassistant: ...\nassistant:
# with tools, a first line `tools: [...]` (their JSON), and an assistant's calls after its
# content as <tool_call>{"name": ..., "arguments": {...}}</tool_call> (the hermes form, which
# kvhold.serving.tool_calls reads back)
PLAIN_TEMPLATE = ("{{ bos_token }}{% if tools %}{{ 'tools: ' + (tools | tojson) + '\\n' }}{% endif %}"
                  "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                  "{% for c in (m['tool_calls'] or []) %}<tool_call>{{ {'name': c['function']['name'], "
                  "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}{{ '\\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


log = logging.getLogger(__name__)
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"


class TemplateError(ValueError):
    pass


def token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content", ""))
    return str(value or "")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", is_plain: bool = False,
                 origin: str = "the plain template"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.source = source
        self.bos_token, self.eos_token, self.is_plain = bos_token, eos_token, is_plain
        self.origin = origin

    @classmethod
    def for_checkpoint(cls, model_dir: Path | None, override: str | None = None) -> "ChatTemplate":
        """The checkpoint's template, or `override` (--chat-template's text) with its tokens."""
        cfg = {}
        path = Path(model_dir) / "tokenizer_config.json" if model_dir else None
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text())
        bos, eos = token_text(cfg.get("bos_token")), token_text(cfg.get("eos_token"))
        if override is not None:
            log.info("chat template: --chat-template")
            return cls(override, bos, eos, origin="--chat-template")
        named = _template_files(Path(model_dir)) if model_dir else {}
        if not named:
            source = cfg.get("chat_template")
            if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
                named = {t.get("name"): (t.get("template"), f"{path}'s chat_template {t.get('name')!r}")
                         for t in source if isinstance(t, dict)}
            elif source:
                named = {"default": (source, f"{path}'s chat_template")}
        named = {k: v for k, v in named.items() if isinstance(k, str) and isinstance(v[0], str) and v[0]}
        if not named:
            log.warning("chat template: %s has none (no %s, no chat_template in tokenizer_config.json): "
                        "using kvhold's plain template (role: content lines)", model_dir, TEMPLATE_FILE)
            return cls(PLAIN_TEMPLATE, bos, eos, is_plain=True)
        source, origin = named.get("default") or next(iter(named.values()))
        log.info("chat template: %s%s", origin, "" if "default" in named else " (none is named default)")
        return cls(source, bos, eos, origin=origin)

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """`tools`: OpenAI's tool definitions, passed as transformers' apply_chat_template passes
        them (None: none, as transformers renders a template without)."""
        try:
            return self.template.render(messages=messages, bos_token=self.bos_token,
                                        eos_token=self.eos_token, add_generation_prompt=True, tools=tools)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template rejected the messages: {exc}") from None


def _template_files(model_dir: Path) -> dict[str, tuple[str, str]]:
    """Templates kept as files, which transformers prefers to tokenizer_config.json's entry:
    chat_template.jinja (named "default") and additional_chat_templates/NAME.jinja.
    Returns {name: (template, its path)}."""
    files = [(model_dir / TEMPLATE_FILE, "default")]
    extra = model_dir / TEMPLATE_DIR
    if extra.is_dir():
        files += [(f, f.stem) for f in sorted(extra.glob("*.jinja"))]
    named = {}
    for f, name in files:
        if f.is_file() and name not in named:
            named[name] = (f.read_text(encoding="utf-8"), str(f))
    return named


def _raise(message: str):
    raise jinja2.TemplateError(message)
