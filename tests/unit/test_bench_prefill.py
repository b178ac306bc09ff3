"""tools/bench_prefill: its model-FLOPs count and its variant settings."""
import argparse
import json

import pytest

from kvhold.protocol.model_spec import ModelSpec
from kvhold.testing.make_model import PRESETS, make_config
from tools.bench_prefill import layer_params, model_flops, parse_variant, served_chunk


def spec_of(preset, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(make_config(preset, 512, 0, 1)))
    return ModelSpec.from_dir(tmp_path)


def test_llama3_8b_flops(tmp_path):
    spec = spec_of("llama3-8b", tmp_path)
    assert layer_params(spec) == 6_979_321_856            # Llama-3-8B less embedding and LM head
    p = 2048
    attention = 2 * 32 * 32 * 128 * p * (p + 1)           # causal QK^T and PV, every layer
    assert model_flops(spec, p) == 2 * p * 6_979_321_856 + attention + 2 * 128256 * 4096
    # attention is about an eighth of the work at 8k tokens, a fiftieth at 512
    assert 0.12 < 1 - 2 * 8192 * layer_params(spec) / model_flops(spec, 8192) < 0.14


def test_variants_are_environment_or_engine_flags():
    assert parse_variant("served:") == ("served", {}, {})
    assert parse_variant("exact:KVHOLD_EXACT_PREFILL=1,prefill_chunk=2048") == (
        "exact", {"KVHOLD_EXACT_PREFILL": "1"}, {"prefill_chunk": 2048})
    for bad in ("x:chunk=5", "x:prefill_chunk=big", "x:novalue", ":A=1", "a b:A=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_variant(bad)


def test_chunking_as_served():
    assert served_chunk("cuda:0", None, 8192, 64) == 2048     # the CUDA executor's default chunk
    assert served_chunk("cuda:0", None, 8192, 64, exact=False) == 512    # padded chunks: short ones
    assert served_chunk("cuda:0", None, 512, 64) == 448
    assert served_chunk("cuda:0", 2048, 8192, 64) == 2048
    assert served_chunk("cpu", None, 512, 64) == 448           # the scheduler's default
    assert PRESETS["llama3-8b"]["max_position_embeddings"] >= 8192 + 512   # an 8k prompt fits, served
