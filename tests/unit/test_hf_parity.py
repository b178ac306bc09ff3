"""Checkpoints as transformers writes them give transformers' outputs.

Each case builds a tiny random model with transformers (`save_pretrained`: its config.json,
its safetensors names, its sharding and tied embeddings), a byte-level BPE tokenizer trained
here by `tokenizers`, and compares kvhold's CPU engine (float64, paged KV, prefill then one
token per step) with the transformers model in float64: the logits of the whole sequence and
the greedy tokens of `generate`.
"""
import dataclasses

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from kvhold.executor.kv_cache import KvCache  # noqa: E402
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput  # noqa: E402
from kvhold.protocol.checkpoint import build_manifest  # noqa: E402
from kvhold.protocol.layout import KvGeometry  # noqa: E402
from kvhold.protocol.model_spec import ModelSpec  # noqa: E402
from kvhold.testing.make_model import train_tokenizer  # noqa: E402
from tests.unit.helpers import CASES, build_checkpoint, hf_greedy  # noqa: E402

PAGE = 4
PROMPT = "The quick brown fox jumps over the lazy dog and the sidecar keeps every page of the cache"
NEW_TOKENS = 10

@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def kvhold_model(path) -> tuple[ModelSpec, LlamaModel]:
    spec = ModelSpec.from_dir(path)
    manifest = build_manifest(path, spec)       # the names and shapes kvhold expects, checked
    weights = {}
    for f in sorted({e.file for e in manifest.entries}):
        weights.update(load_file(str(path / f)))
    return spec, LlamaModel(spec, weights, torch.float64, torch.device("cpu"), 256)


class Session:
    """One sequence through the engine: the prompt as one prefill step, then one token per step."""

    def __init__(self, spec, llm, pages=64):
        self.llm = llm
        self.kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                             "float64", PAGE), pages)
        self.pages = torch.arange(1, pages)
        self.done = 0

    def step(self, ids) -> torch.Tensor:
        n, end = len(ids), self.done + len(ids)
        pos = torch.arange(self.done, end)
        step = StepInput(token_ids=torch.tensor(ids), positions=pos, write_pages=self.pages[pos // PAGE],
                         write_slots=pos % PAGE,
                         seqs=[SeqSlice(0, n, end, self.pages[:(end + PAGE - 1) // PAGE])],
                         logits_rows=torch.arange(n))
        self.done = end
        return self.llm.forward(step, self.kv)


def kvhold_greedy(spec, llm, prompt, n):
    s = Session(spec, llm)
    logits, out = s.step(prompt), []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = s.step([out[-1]])
    return out


def check_parity(path, model, tokenizer, prompt_text=PROMPT, new_tokens=NEW_TOKENS):
    spec, llm = kvhold_model(path)
    prompt = tokenizer.encode(prompt_text).ids
    got = kvhold_greedy(spec, llm, prompt, new_tokens)
    want = hf_greedy(model, prompt, new_tokens)
    assert got == want
    assert len(set(got)) > 1          # the comparison means something: not one token repeated
    full = prompt + got
    with torch.no_grad():
        hf_logits = model(torch.tensor([full])).logits[0]
    kv_logits = Session(spec, llm).step(full)
    # transformers computes its RoPE frequencies in float32, kvhold in float64
    assert (kv_logits - hf_logits).abs().max() < 1e-4
    return spec, llm, full, hf_logits


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_output_equals_transformers(case, tokenizer, tmp_path):
    classes, kwargs = CASES[case]
    model = build_checkpoint(tmp_path, tokenizer, *classes(transformers), **kwargs)
    spec, _, _, _ = check_parity(tmp_path, model, tokenizer)
    assert spec.model_type == case.split("-")[0]
    if case == "gemma3_text":
        assert spec.rope(0) != spec.rope(1) and spec.qk_norm and spec.final_logit_softcap == 8.0
    if case == "llama-tied-sharded":
        assert spec.tie_word_embeddings and len(list(tmp_path.glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize("case,cfg", [
    ("mistral", dict(sliding_window=16)),
    ("phi3", dict(sliding_window=16)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    ("gemma2", dict(sliding_window=16)),             # layer_types by default: sliding, global
    ("gemma3_text", dict(sliding_window=16, sliding_window_pattern=2,
                         rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                          for t in ("sliding_attention", "full_attention")})),
])
def test_sliding_window_past_the_window_equals_transformers(case, cfg, tokenizer, tmp_path):
    t = transformers
    classes = {"mistral": (t.MistralConfig, t.MistralForCausalLM), "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
               "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM), "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
               "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM),
               "gemma3_text": (t.Gemma3TextConfig, t.Gemma3ForCausalLM)}
    model = build_checkpoint(tmp_path, tokenizer, *classes[case], **cfg)
    spec, llm, full, hf_logits = check_parity(tmp_path, model, tokenizer, new_tokens=12)
    assert len(full) > 2 * 16                    # prompt + generation well past the window
    # qwen: from max_window_layers on; gemma: every second layer global
    want = {"mistral": (16, 16), "phi3": (16, 16), "gemma2": (16, None), "gemma3_text": (16, None)}.get(
        case, (None, 16))
    assert spec.sliding_windows == want
    # and the window matters here: attending over everything gives other logits
    full_attention = LlamaModel(dataclasses.replace(spec, sliding_windows=()), llm.w, torch.float64,
                                torch.device("cpu"), 256)
    other = Session(spec, full_attention).step(full)
    assert not torch.allclose(other[20:], hf_logits[20:], atol=1e-3)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "phi3"])
def test_family_checkpoints_written_without_transformers_are_what_transformers_reads(family, tokenizer, tmp_path):
    """kvhold.testing.families writes these for machines without transformers (the GPU tests):
    transformers loads each as its family, and its outputs equal kvhold's."""
    from kvhold.testing.families import build_family

    path = build_family(tmp_path / family, family)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    assert type(model).__name__ == {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                    "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}[family]
    spec, _, _, _ = check_parity(path, model, tokenizer)
    assert spec.model_type == family


# config.json as published for Gemma 2 2B and Gemma 3 1B (written by older transformers: no
# layer_types, rope_theta / rope_local_base_freq / sliding_window_pattern), shrunk
HUB_CONFIGS = {
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   cache_implementation="hybrid", eos_token_id=[1, 107], head_dim=256,
                   hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=256, rope_theta=10000.0, sliding_window=4096, torch_dtype="float32"),
    "gemma3_text": dict(model_type="gemma3_text", attn_logit_softcapping=None, final_logit_softcapping=None,
                        eos_token_id=[1, 106], head_dim=256, hidden_activation="gelu_pytorch_tanh",
                        query_pre_attn_scalar=256, rope_local_base_freq=10000, rope_scaling=None,
                        rope_theta=1000000, sliding_window=512, sliding_window_pattern=6,
                        torch_dtype="bfloat16"),
}


@pytest.mark.parametrize("case", sorted(HUB_CONFIGS))
def test_published_gemma_configs_read_as_transformers_reads_them(case):
    cfg = {**HUB_CONFIGS[case], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 13,
           "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 512, "max_position_embeddings": 2048}
    spec = ModelSpec.from_config(cfg)
    hf = transformers.AutoConfig.for_model(**cfg)
    assert spec.sliding_windows == tuple(hf.sliding_window if t == "sliding_attention" else None
                                         for t in hf.layer_types)
    assert spec.final_logit_softcap == hf.final_logit_softcapping
    assert spec.attn_logit_softcap == hf.attn_logit_softcapping
    assert spec.attn_scale == hf.query_pre_attn_scalar ** -0.5 and spec.tie_word_embeddings
    rope = hf.rope_parameters
    for layer, kind in enumerate(hf.layer_types):
        theta, scaling = spec.rope(layer)
        assert theta == (rope[kind] if case == "gemma3_text" else rope)["rope_theta"]
        assert scaling.kind == "default"
    if case == "gemma3_text":
        assert spec.sliding_windows.count(None) == 2 and spec.rope(0) != spec.rope(5)
