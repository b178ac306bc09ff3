"""The paged engine computes what a plain dense Llama computes, however the work is split."""
import json

import pytest
import torch
from safetensors.torch import load_file

from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput, rope_inv_freq
from kvhold.protocol.layout import KvGeometry
from kvhold.protocol.model_spec import ModelSpec


@pytest.fixture(scope="module")
def model(tiny_model):
    spec = ModelSpec.from_dir(tiny_model)
    weights = load_file(str(tiny_model / "model.safetensors"))
    return spec, weights, LlamaModel(spec, weights, torch.float64, torch.device("cpu"), 512)


def dense_logits(spec, w, ids):
    """A straightforward full-sequence Llama forward, written independently of the engine."""
    d = {k: v.double() for k, v in w.items()}
    n = len(ids)
    x = d["model.embed_tokens.weight"][torch.tensor(ids)]
    inv = rope_inv_freq(spec)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]

    def rot(t):
        h = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., h:], t[..., :h]], -1) * sin

    def norm(t, wt):
        return wt * t / torch.sqrt((t * t).mean(-1, keepdim=True) + spec.rms_norm_eps)

    hd, nh, nkv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = norm(x, d[p + "input_layernorm.weight"])
        q = rot((a @ d[p + "self_attn.q_proj.weight"].T).view(n, nh, hd))
        k = rot((a @ d[p + "self_attn.k_proj.weight"].T).view(n, nkv, hd))
        v = (a @ d[p + "self_attn.v_proj.weight"].T).view(n, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
        att = att.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", att.softmax(-1), v).reshape(n, -1)
        x = x + o @ d[p + "self_attn.o_proj.weight"].T
        b = norm(x, d[p + "post_attention_layernorm.weight"])
        x = x + (torch.nn.functional.silu(b @ d[p + "mlp.gate_proj.weight"].T)
                 * (b @ d[p + "mlp.up_proj.weight"].T)) @ d[p + "mlp.down_proj.weight"].T
    return norm(x, d["model.norm.weight"]) @ d["lm_head.weight"].T


def run_chunks(spec, llm, ids, chunks, page_tokens=4):
    geom = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", page_tokens)
    kv = KvCache.private(geom, 16)
    pages = torch.arange(16)
    done, out = 0, []
    for n in chunks:
        pos = torch.arange(done, done + n)
        step = StepInput(token_ids=torch.tensor(ids[done:done + n]), positions=pos,
                         write_pages=pages[pos // page_tokens], write_slots=pos % page_tokens,
                         seqs=[SeqSlice(0, n, done + n, pages[:(done + n + page_tokens - 1) // page_tokens])],
                         logits_rows=torch.arange(n))
        out.append(llm.forward(step, kv))
        done += n
    return torch.cat(out)


def test_prefill_decode_and_chunks_match_a_dense_forward(model):
    spec, weights, llm = model
    ids = [0, 53, 278, 450, 222, 76, 70, 70, 81, 84, 439, 261, 77, 74, 283, 15, 9, 300]
    want = dense_logits(spec, weights, ids)
    for chunks in ([18], [1] * 18, [5, 1, 7, 5], [3, 3, 3, 3, 3, 3]):
        got = run_chunks(spec, llm, ids, chunks)
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-9), chunks


def test_two_sequences_in_one_step_equal_each_alone(model):
    spec, _, llm = model
    geom = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", 4)
    a, b = [0, 5, 9, 13, 2], [0, 7, 7, 100, 101, 102, 3]
    kv = KvCache.private(geom, 8)
    pa, pb = torch.tensor([0, 1]), torch.tensor([4, 5])
    pos = torch.cat([torch.arange(5), torch.arange(7)])
    pages = torch.cat([pa[torch.arange(5) // 4], pb[torch.arange(7) // 4]])
    step = StepInput(token_ids=torch.tensor(a + b), positions=pos, write_pages=pages,
                     write_slots=pos % 4, seqs=[SeqSlice(0, 5, 5, pa), SeqSlice(5, 7, 7, pb)],
                     logits_rows=torch.tensor([4, 11]))
    both = llm.forward(step, kv)
    assert torch.allclose(both[0], run_chunks(spec, llm, a, [5])[-1], atol=1e-12)
    assert torch.allclose(both[1], run_chunks(spec, llm, b, [7])[-1], atol=1e-12)


def test_llama3_rope_scaling_changes_only_low_frequencies(tiny_model):
    cfg = json.loads((tiny_model / "config.json").read_text())
    scaled = rope_inv_freq(ModelSpec.from_config(cfg))
    cfg.pop("rope_scaling")
    plain = rope_inv_freq(ModelSpec.from_config(cfg))
    assert torch.equal(scaled[:2], plain[:2])          # high frequencies untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8)   # lowest frequency divided by the factor
