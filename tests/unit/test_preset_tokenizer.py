"""The tokenizers of the checkpoint presets: one that covers a model's whole vocabulary decodes
every id (but the two special ones) to text of its own, so a generated id stream is one text
piece per token through the sidecar's incremental detokenizer."""
import json
import random

import pytest

pytest.importorskip("tokenizers")

from kvhold.frontend.detokenizer import IncrementalDetokenizer  # noqa: E402
from kvhold.testing.make_model import (PRESETS, RESERVED, covering_tokenizer, make_config,  # noqa: E402
                                       tokenizer_for, train_tokenizer)

LLAMA3_VOCAB = PRESETS["llama3-8b"]["vocab_size"]


@pytest.fixture(scope="module")
def llama3_tokenizer():
    return covering_tokenizer(LLAMA3_VOCAB)


def specials(tok) -> set[int]:
    return {tok.token_to_id("<s>"), tok.token_to_id("</s>")}


def test_every_id_of_the_llama3_preset_decodes_to_text(llama3_tokenizer):
    tok = llama3_tokenizer
    assert tok.get_vocab_size() == LLAMA3_VOCAB == 128256
    texts = tok.decode_batch([[i] for i in range(LLAMA3_VOCAB)], skip_special_tokens=True)
    empty = [i for i, t in enumerate(texts) if not t]
    broken = [i for i, t in enumerate(texts) if "\ufffd" in t]
    assert set(empty) == specials(tok) and broken == []
    assert texts[LLAMA3_VOCAB - 1] == RESERVED.format(LLAMA3_VOCAB - 1)


def test_a_generated_stream_is_one_piece_per_token(llama3_tokenizer):
    tok = llama3_tokenizer
    rng = random.Random(0)
    prompt = tok.encode("The sidecar keeps the memory").ids
    stream = [rng.randrange(LLAMA3_VOCAB) for _ in range(3000)] + list(range(600)) + [5, 5, 600, 600, 7]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(i) for i in stream]
    assert detok.flush() == ""
    for token, piece in zip(stream, pieces):
        assert bool(piece) == (token not in specials(tok)), (token, piece)
        assert piece == tok.decode([token], skip_special_tokens=True)
    assert "".join(pieces) == tok.decode(stream, skip_special_tokens=True)


def test_encoding_is_the_ascii_bpe_and_never_a_reserved_token(llama3_tokenizer):
    tok = llama3_tokenizer
    enc = tok.encode(f"Hello café {RESERVED.format(700)} ü!")
    assert max(enc.ids) < 512                        # reserved entries are never produced
    assert enc.ids[0] == tok.token_to_id("<s>")
    unk = tok.token_to_id("<unk>")
    assert enc.ids.count(unk) == 2                   # é and ü: one <unk> each, not dropped
    assert tok.decode(enc.ids, skip_special_tokens=True) == f"Hello caf<unk> {RESERVED.format(700)} <unk>!"


def test_each_preset_gets_a_tokenizer_of_its_vocabulary():
    for preset in ("llama3-tiny",):
        tok = tokenizer_for(preset)
        cfg = make_config(preset, tok.get_vocab_size(), tok.token_to_id("<s>"), tok.token_to_id("</s>"))
        assert tok.get_vocab_size() == cfg["vocab_size"] == PRESETS[preset]["vocab_size"]
    # the demo model's tokenizer is the 512-token byte-level BPE, unchanged
    assert json.loads(tokenizer_for("tiny").to_str()) == json.loads(train_tokenizer().to_str())
    assert tokenizer_for("tiny").get_vocab_size() == 512
    with pytest.raises(ValueError, match="smaller than the base"):
        covering_tokenizer(100)
