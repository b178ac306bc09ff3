"""Chat messages -> prompt text, as Hugging Face's `apply_chat_template` does.

The checkpoint's `tokenizer_config.json` may carry a Jinja `chat_template` (a string,
or a list of named templates of which "default" is used). It is rendered in a
sandboxed Jinja environment with `messages`, `bos_token`, `eos_token`,
`add_generation_prompt=True` and `raise_exception`, like transformers. A checkpoint
without one gets the documented plain template below. The text is tokenized with
no special tokens added: the template writes the BOS token itself.
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when the checkpoint defines no chat template:
#   <bos>system: ...\nuser: ...\nassistant: ...\nassistant:
PLAIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


class TemplateError(ValueError):
    pass


def _token_text(value) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        return str(value.get("content", ""))
    return str(value or "")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", is_plain: bool = False):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token, self.is_plain = bos_token, eos_token, is_plain

    @classmethod
    def for_checkpoint(cls, model_dir: Path | None) -> "ChatTemplate":
        cfg = {}
        path = Path(model_dir) / "tokenizer_config.json" if model_dir else None
        if path is not None and path.is_file():
            cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default") or next(iter(named.values()), None)
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        if not source:
            return cls(PLAIN_TEMPLATE, bos, eos, is_plain=True)
        return cls(source, bos, eos)

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, bos_token=self.bos_token,
                                        eos_token=self.eos_token, add_generation_prompt=True)
        except jinja2.TemplateError as exc:
            raise TemplateError(f"the chat template rejected the messages: {exc}") from None


def _raise(message: str):
    raise jinja2.TemplateError(message)
