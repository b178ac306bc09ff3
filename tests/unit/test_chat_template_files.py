"""The chat template is found where transformers finds it, and the one used is logged."""
import json
import logging

import pytest

transformers = pytest.importorskip("transformers")

from kvhold.serving.chat_template import ChatTemplate  # noqa: E402
from kvhold.testing.make_model import train_tokenizer  # noqa: E402

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again"}]
FILE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
CONFIG_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
TOOL_TEMPLATE = "{% for m in messages %}TOOL {{ m['content'] }}{% endfor %}"


def save_tokenizer(path, template):
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), bos_token="<s>",
                                               eos_token="</s>")
    tok.chat_template = template
    tok.save_pretrained(path)
    return transformers.AutoTokenizer.from_pretrained(path)


def hf_render(tok):
    return tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_chat_template_jinja_as_transformers_5_saves_it(tmp_path, caplog):
    tok = save_tokenizer(tmp_path, FILE_TEMPLATE)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    with caplog.at_level(logging.INFO, logger="kvhold.serving.chat_template"):
        template = ChatTemplate.for_checkpoint(tmp_path)
    assert not template.is_plain
    assert template.render(MESSAGES) == hf_render(tok)
    assert template.render(MESSAGES).startswith("<s><|system|>Be brief.</s>")
    assert f"chat template: {tmp_path / 'chat_template.jinja'}" in caplog.text


def test_the_file_wins_over_tokenizer_config_as_in_transformers(tmp_path):
    save_tokenizer(tmp_path, FILE_TEMPLATE)
    cfg_path = tmp_path / "tokenizer_config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": CONFIG_TEMPLATE}))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES) == hf_render(tok)
    assert "<|system|>" in hf_render(tok)
    (tmp_path / "chat_template.jinja").unlink()        # without the file, the config's entry
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    template = ChatTemplate.for_checkpoint(tmp_path)
    want = "".join(f"[{m['role']}] {m['content']}\n" for m in MESSAGES) + "[assistant]"
    assert template.render(MESSAGES) == hf_render(tok) == want
    assert template.origin == f"{tmp_path / 'tokenizer_config.json'}'s chat_template"


def test_named_templates_use_the_default(tmp_path):
    tok = save_tokenizer(tmp_path, {"default": FILE_TEMPLATE, "tool_use": TOOL_TEMPLATE})
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    assert ChatTemplate.for_checkpoint(tmp_path).render(MESSAGES) == hf_render(tok)


def test_no_template_anywhere_is_the_plain_one_with_a_warning(tmp_path, caplog):
    save_tokenizer(tmp_path, None)
    with caplog.at_level(logging.INFO, logger="kvhold.serving.chat_template"):
        template = ChatTemplate.for_checkpoint(tmp_path)
    assert template.is_plain
    assert template.render(MESSAGES[:2]) == "<s>system: Be brief.\nuser: Hello\nassistant:"
    assert any(r.levelno == logging.WARNING and "plain template" in r.getMessage() for r in caplog.records)
