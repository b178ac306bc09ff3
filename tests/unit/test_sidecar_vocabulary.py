"""Token ids past the model's vocabulary never reach an executor: a tokenizer that can produce
them is refused when the frontend loads it, and a text prompt's ids are checked at admission
like a token-id prompt's (a frontend over real shared tables and the demo checkpoint)."""
import shutil

import pytest
from tokenizers import Tokenizer

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.model_spec import ModelSpec
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.frontend.frontend import Frontend
from kvhold.sidecar.timeline import RecoveryTimeline
from kvhold.testing.frontend_host import FrontendHost

EXTRA = ["<extra-a>", "<extra-b>"]


@pytest.fixture
def table_geometry():
    return TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4, max_seq_len=64,
                         num_leases=2)


def _bigger_tokenizer(model_dir) -> Tokenizer:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens(EXTRA)
    return tok


def _frontend(tables, model_dir, tmp_path) -> Frontend:
    host = FrontendHost()
    host.frontend = Frontend(tables, ModelSpec.from_dir(model_dir), model_dir, runs_model=True,
                             durable=DurableJournal(tmp_path / "journal"), fingerprint="f",
                             timeline=RecoveryTimeline(), host=host)
    return host.frontend


def _generate(frontend, tag, prompt):
    """A text prompt is tokenized off the loop: its answer is sent once it is back and on disk."""
    assert frontend.handle(b"uclient", m.Generate(tag=tag, params={"max_tokens": 2}, prompt=prompt)) is None
    return frontend.host.reply(tag)


def test_a_tokenizer_with_ids_past_the_vocabulary_is_refused(tiny_model, tables, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    vocab = ModelSpec.from_dir(model).vocab_size
    _bigger_tokenizer(model).save(str(model / "tokenizer.json"))
    with pytest.raises(ValueError) as info:
        _frontend(tables, model, tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"produces token ids up to {vocab + len(EXTRA) - 1}" in msg and f"vocab_size is {vocab}" in msg


def test_a_text_prompt_whose_ids_leave_the_vocabulary_is_refused(tiny_model, tables, tmp_path):
    frontend = _frontend(tables, tiny_model, tmp_path)
    ok = _generate(frontend, 1, "hello <extra-a>")
    assert isinstance(ok, m.Accepted)
    frontend.tokenizer = frontend.prompts.tokenizer = _bigger_tokenizer(tiny_model)   # as if it changed under the model
    reply = _generate(frontend, 2, "hello <extra-a>")
    assert isinstance(reply, m.Error) and reply.code == ErrorCode.INVALID_TOKEN and reply.tag == 2
    assert "of the tokenized prompt" in reply.message and "outside the vocabulary" in reply.message
    assert len(frontend.streams) == 1
