"""`kvhold serve` over a checkpoint's own files: chat_template.jinja and generation_config.json's end ids."""
import json
import shutil

from tokenizers import Tokenizer

from tests.process.helpers import Server

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


def test_the_served_model_uses_its_template_file_and_every_end_id(tiny_model, tmp_path, runtime_root):
    ckpt = tmp_path / "model"
    shutil.copytree(tiny_model, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    eos = cfg["eos_token_id"]
    # every id ends a request: the first generated token stops it, whatever it is
    ends = [eos] + [i for i in range(cfg["vocab_size"]) if i != eos]
    (ckpt / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"],
                                                             "eos_token_id": ends}))
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    log = tmp_path / "serve.log"
    srv = Server(ckpt, runtime_root, log, "--standbys", "0", "--log-level", "INFO")
    try:
        body = {"prompt": "The sidecar keeps the memory", "max_tokens": 6, "temperature": 0}
        stopped = srv.post("/v1/completions", body).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == 1
        full = srv.post("/v1/completions", {**body, "ignore_eos": True}).json()
        assert full["choices"][0]["finish_reason"] == "length"
        assert full["usage"]["completion_tokens"] == 6

        chat = srv.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}).json()
        assert chat["choices"][0]["finish_reason"] == "stop"
        text = "<s><|system|>Be brief.</s><|user|>The quick brown fox</s><|assistant|>"
        ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(text, add_special_tokens=False).ids
        assert chat["usage"]["prompt_tokens"] == len(ids)
    finally:
        srv.stop()
    assert f"chat template: {ckpt / 'chat_template.jinja'}" in log.read_text()
