"""ModelSpec reads what a Hugging Face checkpoint says, and refuses what kvhold does not implement."""
import json
import shutil

import pytest

from kvhold.protocol.model_spec import CheckpointError, ModelSpec
from kvhold.sidecar.config import ExecutorsConfig, PoolConfig, SidecarConfig

BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def spec_of(**cfg):
    return ModelSpec.from_config({**BASE, **cfg})


@pytest.fixture
def ckpt(tiny_model, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model, path)
    return path


def test_generation_config_end_ids_join_the_configs(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    eos = cfg["eos_token_id"]
    assert ModelSpec.from_dir(ckpt).eos_token_ids == (eos,)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7, 9, 7]}))
    assert ModelSpec.from_dir(ckpt).eos_token_ids == (eos, 7, 9)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    assert ModelSpec.from_dir(ckpt).eos_token_ids == (eos, 11)
    (ckpt / "generation_config.json").write_text(json.dumps({"do_sample": True}))
    assert ModelSpec.from_dir(ckpt).eos_token_ids == (eos,)
    (ckpt / "generation_config.json").unlink()
    assert ModelSpec.from_dir(ckpt).eos_token_ids == (eos,)


@pytest.mark.parametrize("body,needle", [
    ("{nope", "generation_config.json: not valid JSON"),
    (json.dumps({"eos_token_id": [2, "x"]}),
     "generation_config.json: eos_token_id must be an integer or a list of integers"),
    (json.dumps({"eos_token_id": [2, 100000]}), "generation_config.json: eos_token_id \\[100000\\] outside"),
])
def test_a_bad_generation_config_is_refused_with_the_file(ckpt, body, needle):
    (ckpt / "generation_config.json").write_text(body)
    with pytest.raises(CheckpointError, match=needle):
        ModelSpec.from_dir(ckpt)


def test_eos_list_in_config_json():
    assert spec_of(eos_token_id=[3, 4]).eos_token_ids == (3, 4)
    assert spec_of(eos_token_id=5).eos_token_ids == (5,)
    assert spec_of().eos_token_ids == ()


@pytest.mark.parametrize("cfg,windows", [
    (dict(model_type="llama", sliding_window=16), ()),                  # LlamaAttention has none
    (dict(model_type="mistral", sliding_window=16), (16, 16, 16)),
    (dict(model_type="mistral", sliding_window=None), ()),
    (dict(model_type="mistral"), ()),
    (dict(model_type="phi3", sliding_window=8), (8, 8, 8)),
    (dict(model_type="qwen2", sliding_window=16), ()),                  # use_sliding_window false
    (dict(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
     (None, 16, 16)),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=16,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"]), (16, None, 16)),
    (dict(model_type="qwen3", use_sliding_window=False, sliding_window=16,
          layer_types=["full_attention"] * 3), ()),
])
def test_sliding_windows_per_layer_as_transformers_applies_them(cfg, windows):
    assert spec_of(**cfg).sliding_windows == windows


@pytest.mark.parametrize("cfg,needle", [
    (dict(model_type="gemma3"), "only the text model, model_type gemma3_text"),
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation 'gelu' is not supported"),
    (dict(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(model_type="gemma3_text", attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0 is not supported"),
    (dict(model_type="gemma2", sliding_window=None), "sliding_attention layers need a sliding_window"),
    (dict(model_type="gemma2", final_logit_softcapping=0), "final_logit_softcap must be positive"),
    (dict(model_type="gpt2"), "model_type 'gpt2' is not supported"),
    (dict(model_type="llama", hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    (dict(model_type="phi3", partial_rotary_factor=0.75), "partial_rotary_factor 0.75 is not supported"),
    (dict(model_type="phi3", rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8,
                                           "long_factor": [1.0] * 8}), "rope scaling type 'longrope'"),
    (dict(model_type="qwen3", use_sliding_window=True, sliding_window=4,
          layer_types=["chunked_attention"] * 3), "layer_types \\['chunked_attention'\\]"),
    (dict(model_type="mistral", sliding_window=0), "sliding_window must be positive"),
])
def test_what_the_engine_does_not_implement_is_refused(cfg, needle):
    with pytest.raises(ValueError, match=needle):
        spec_of(**cfg)


def test_qwen3_and_phi3_tensor_names():
    qwen3 = spec_of(model_type="qwen3", num_hidden_layers=1).expected_tensors()
    assert qwen3["model.layers.0.self_attn.q_norm.weight"] == (16,)
    assert qwen3["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert "model.layers.0.self_attn.q_proj.bias" not in qwen3
    phi3 = spec_of(model_type="phi3", num_hidden_layers=1).expected_tensors()
    assert phi3["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 2 * 32, 64)
    assert phi3["model.layers.0.mlp.gate_up_proj.weight"] == (256, 64)
    assert "model.layers.0.self_attn.q_proj.weight" not in phi3


def test_gemma_tensor_names_and_defaults():
    gemma2 = spec_of(model_type="gemma2", num_hidden_layers=1)
    names = gemma2.expected_tensors()
    assert names["model.layers.0.pre_feedforward_layernorm.weight"] == (64,)
    assert names["model.layers.0.post_feedforward_layernorm.weight"] == (64,)
    assert "lm_head.weight" not in names and "model.layers.0.self_attn.q_norm.weight" not in names
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.attn_scale) == (50.0, 30.0, 256 ** -0.5)
    gemma3 = spec_of(model_type="gemma3_text", num_hidden_layers=1)
    assert gemma3.expected_tensors()["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert (gemma3.attn_logit_softcap, gemma3.final_logit_softcap) == (None, None)


def test_the_cuda_engine_refuses_what_its_kernels_do_not_implement(ckpt):
    assert spec_of(model_type="mistral", sliding_window=4096).cuda_refusal(4096) is None
    assert "sliding window of 16 positions" in spec_of(model_type="mistral", sliding_window=16).cuda_refusal(17)
    assert spec_of(model_type="mistral", sliding_window=16).cuda_refusal(16) is None
    assert spec_of(model_type="qwen3").cuda_refusal(64) is None
    assert spec_of(model_type="phi3").cuda_refusal(64) is None
    assert "CPU engine only" in spec_of(model_type="gemma2").cuda_refusal(64)
    assert "CPU engine only" in spec_of(model_type="gemma3_text").cuda_refusal(64)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "model_type": "mistral", "sliding_window": 32}))
    spec = ModelSpec.from_dir(ckpt)
    cuda = SidecarConfig(pool=PoolConfig(model=ckpt, backend="cuda", device="cuda", max_seq_len=64))
    with pytest.raises(ValueError, match="use --max-seq-len 32 or less, or --device cpu"):
        cuda.table_geometry(spec)
    SidecarConfig(pool=PoolConfig(model=ckpt, max_seq_len=64)).table_geometry(spec)      # CPU: windowed
    SidecarConfig(pool=PoolConfig(model=ckpt, backend="cuda", device="cuda", max_seq_len=32)).table_geometry(spec)
    SidecarConfig(pool=PoolConfig(model=ckpt, backend="cuda", device="cuda", max_seq_len=64),
                  executors=ExecutorsConfig(workload="idle")).table_geometry(spec)
