"""Token ids past the model's vocabulary never reach an executor: a tokenizer that can produce
them is refused when the frontend loads it, and a text prompt's ids are checked at admission
like a token-id prompt's (a frontend over real shared tables and the demo checkpoint)."""
import os
import queue
import shutil
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from kvhold.protocol import messages as m
from kvhold.protocol.errors import ErrorCode
from kvhold.protocol.layout import KvGeometry, TableGeometry
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.tables import Tables
from kvhold.sidecar.durable_journal import DurableJournal
from kvhold.sidecar.frontend import Frontend
from kvhold.sidecar.timeline import RecoveryTimeline

EXTRA = ["<extra-a>", "<extra-b>"]


class Host:
    """The sidecar around the frontend: what it sends, and its loop's posted callbacks."""

    def __init__(self):
        self.sent: list[tuple[bytes, object]] = []
        self.posted: queue.SimpleQueue = queue.SimpleQueue()

    def send_client(self, client_key, msg):
        self.sent.append((client_key, msg))

    def wake_executor(self):
        pass

    def status(self):
        return {}

    def post(self, callback):
        self.posted.put(callback)

    def reply(self, frontend, tag, timeout=10.0):
        """Run loop turns (posted callbacks, then admissions on disk) until `tag` is answered."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, msg in self.sent:
                if getattr(msg, "tag", None) == tag:
                    return msg
            try:
                self.posted.get(timeout=0.05)()
            except queue.Empty:
                pass
            frontend._admit_ready()
        raise TimeoutError(f"no reply for tag {tag}")


@pytest.fixture
def tables():
    g = TableGeometry(kv=KvGeometry(2, 2, 8, "float32", 4), num_pages=16, num_slots=4, max_seq_len=64,
                      num_leases=2)
    t = Tables.create(f"/kvhold-test-{os.getpid()}-{np.random.randint(1 << 30)}", g, generation=1)
    yield t
    t.unlink()


def _bigger_tokenizer(model_dir) -> Tokenizer:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens(EXTRA)
    return tok


def _frontend(tables, model_dir, tmp_path) -> Frontend:
    return Frontend(tables, ModelSpec.from_dir(model_dir), model_dir, runs_model=True,
                    durable=DurableJournal(tmp_path / "journal"), fingerprint="f",
                    timeline=RecoveryTimeline(), host=Host())


def _generate(frontend, tag, prompt):
    """A text prompt is tokenized off the loop: its answer is sent once it is back and on disk."""
    assert frontend.handle(b"uclient", m.Generate(tag=tag, params={"max_tokens": 2}, prompt=prompt)) is None
    return frontend.host.reply(frontend, tag)


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
