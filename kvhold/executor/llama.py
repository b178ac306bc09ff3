"""The reference Llama-family decoder over paged KV: RMSNorm, RoPE (with Llama-3
frequency scaling), grouped-query attention, SwiGLU, optional q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3, Gemma 3), fused q|k|v and gate|up tensors (Phi-3),
sliding-window attention per layer (Mistral, Phi-3, Qwen2/3 where configured, Gemma: a
query at position p attends to positions p-W+1..p, as transformers' sliding-window mask),
and Gemma 2/3's arithmetic (scaled embeddings, (1 + w) RMSNorm in float32, norms after
attention and around the MLP, GELU-tanh, query_pre_attn_scalar, soft-capped attention
scores and logits, a RoPE base per layer type).

Weights are tensors viewing the sidecar's weights region (never copied into the
process); arithmetic runs in `compute_dtype`. One `forward` serves a mixed step:
prefill chunks and decode tokens of many sequences, concatenated along one token
axis. Each layer first writes the step's keys/values into the pool, then every
sequence attends over its pages read back from the pool. Conventions follow
Hugging Face `transformers` (rotate-half RoPE, RMSNorm in float32 for half
types) so that its checkpoints give its outputs. On CUDA the layers run through
kvhold.executor.cuda.layers (fused projections and elementwise kernels, same model).
FP8 checkpoints keep their quantized Linear weights in float8_e4m3fn in the region with
their scales (kvhold.executor.fp8): the CPU path dequantizes each on use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvhold.executor.fp8 import Fp8Weight, fp8_weights
from kvhold.executor.kv_cache import KvCache
from kvhold.protocol.model_spec import ModelSpec


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a step: tokens [start, start+n) of the step's token axis,
    attending over its first `context` positions (which include these n)."""
    start: int
    n: int
    context: int
    pages: torch.Tensor


@dataclass(slots=True)
class StepInput:
    token_ids: torch.Tensor       # [T]
    positions: torch.Tensor       # [T]
    write_pages: torch.Tensor     # [T] page of each new token's KV
    write_slots: torch.Tensor     # [T] slot inside that page
    seqs: list[SeqSlice]
    logits_rows: torch.Tensor     # [S] rows of T whose logits are wanted


def rope_inv_freq(spec: ModelSpec, layer: int = 0) -> torch.Tensor:
    """The RoPE inverse frequencies of `layer` (the same on every layer but Gemma 3's)."""
    dim = spec.head_dim
    theta, rs = spec.rope(layer)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rs.kind == "linear":
        return inv / rs.factor
    if rs.kind != "llama3":
        return inv
    low_wavelen = rs.original_max_position / rs.low_freq_factor
    high_wavelen = rs.original_max_position / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], compute_dtype: torch.dtype,
                 device: torch.device, max_positions: int):
        if device.type == "cuda" and (refusal := spec.cuda_refusal(max_positions)) is not None:
            raise ValueError(refusal)
        self.spec = spec
        self.w = weights
        self.fp8 = fp8_weights(spec, weights)      # the quantized Linear weights, by name
        self.dtype = compute_dtype
        self.device = device
        self.cos, self.sin = self._rope_tables(rope_inv_freq(spec), max_positions)
        # per layer: (cos, sin), shared between the layers of one RoPE (all of them, but on Gemma 3)
        tables = {spec.rope(0): (self.cos, self.sin)}
        for layer in range(spec.num_layers):
            if spec.rope(layer) not in tables:
                tables[spec.rope(layer)] = self._rope_tables(rope_inv_freq(spec, layer), max_positions)
        self.layer_rope = [tables[spec.rope(layer)] for layer in range(spec.num_layers)]
        self.scale = spec.attn_scale
        self.embed_scale = None
        if spec.gemma:   # transformers: sqrt(hidden) as a float32 tensor, cast to the embedding's dtype
            embed = weights["model.embed_tokens.weight"]
            self.embed_scale = torch.tensor(spec.hidden_size ** 0.5, dtype=torch.float32).to(embed.dtype)
        self.group = spec.num_heads // spec.num_kv_heads
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self.fused = None
        if device.type == "cuda":
            from kvhold.executor.cuda.layers import FusedLayers, fused_enabled

            self.fused = FusedLayers(self) if fused_enabled() else None

    def _rope_tables(self, inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(device=self.device, dtype=self.dtype), emb.sin().to(device=self.device, dtype=self.dtype)

    def _weight(self, name: str) -> torch.Tensor:
        if (q := self.fp8.get(name)) is not None:
            return q.dequantize(self.dtype)
        w = self.w[name]
        return w if w.dtype == self.dtype else w.to(self.dtype)

    def linear_weight(self, name: str) -> torch.Tensor | Fp8Weight:
        """A Linear weight as the fused CUDA layers take it: in the compute dtype, or FP8 with
        its scales (never dequantized here)."""
        return self.fp8.get(name) or self._weight(name)

    def _linear(self, x, name: str, bias: bool = False):
        b = self._weight(name.replace(".weight", ".bias")) if bias else None
        return F.linear(x, self._weight(name), b)

    def _rmsnorm(self, x, name: str):
        if self.spec.gemma:   # Gemma: (x_hat * (1 + w)) in float32 at least, then cast (transformers)
            xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            w = self.w[name].to(xf.dtype)
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
            return (xf * (1.0 + w)).to(x.dtype)
        w = self._weight(name)
        if x.dtype in (torch.float16, torch.bfloat16):
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps)
            return w * xf.to(x.dtype)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.spec.rms_norm_eps))

    @torch.inference_mode()
    def forward(self, step: StepInput, kv: KvCache) -> torch.Tensor:
        """Run one step; returns logits [len(logits_rows), vocab]."""
        h = self.layers(step.token_ids, step.positions, step.write_pages, step.write_slots, kv,
                        lambda layer, q: self._attention(layer, q, step, kv))
        return self.logits(h[step.logits_rows])

    def layers(self, token_ids, positions, write_pages, write_slots, kv: KvCache, attend) -> torch.Tensor:
        """Every decoder layer over a flat token axis; `attend(layer, q)` does attention after the
        step's keys/values were written to the pool. Returns the last hidden states."""
        if self.fused is not None:
            return self.fused.layers(token_ids, positions, write_pages, write_slots, kv, attend)
        spec = self.spec
        t = token_ids.shape[0]
        h = self.w["model.embed_tokens.weight"][token_ids]
        if self.embed_scale is not None:
            h = h * self.embed_scale
        h = h.to(self.dtype)
        ropes = {id(c): (c[positions][:, None], s[positions][:, None]) for c, s in self.layer_rope}
        act = F.silu if spec.hidden_act == "silu" else lambda g: F.gelu(g, approximate="tanh")
        bias = spec.attention_bias
        nq, nkv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        for layer in range(spec.num_layers):
            p = f"model.layers.{layer}."
            x = self._rmsnorm(h, p + "input_layernorm.weight")
            if spec.fused_tensors:
                q, k, v = self._linear(x, p + "self_attn.qkv_proj.weight").split([nq, nkv, nkv], dim=-1)
            else:
                q = self._linear(x, p + "self_attn.q_proj.weight", bias)
                k = self._linear(x, p + "self_attn.k_proj.weight", bias)
                v = self._linear(x, p + "self_attn.v_proj.weight", bias)
            q = q.reshape(t, spec.num_heads, spec.head_dim)
            k = k.reshape(t, spec.num_kv_heads, spec.head_dim)
            v = v.reshape(t, spec.num_kv_heads, spec.head_dim)
            if spec.qk_norm:
                q = self._rmsnorm(q, p + "self_attn.q_norm.weight")
                k = self._rmsnorm(k, p + "self_attn.k_norm.weight")
            cos, sin = ropes[id(self.layer_rope[layer][0])]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            kv.write(layer, write_pages, write_slots, k, v)
            attn = attend(layer, q)
            out = self._linear(attn.reshape(t, -1), p + "self_attn.o_proj.weight")
            if spec.gemma:
                h = h + self._rmsnorm(out, p + "post_attention_layernorm.weight")
                x = self._rmsnorm(h, p + "pre_feedforward_layernorm.weight")
            else:
                h = h + out
                x = self._rmsnorm(h, p + "post_attention_layernorm.weight")
            if spec.fused_tensors:
                gate, up = self._linear(x, p + "mlp.gate_up_proj.weight").chunk(2, dim=-1)
            else:
                gate = self._linear(x, p + "mlp.gate_proj.weight")
                up = self._linear(x, p + "mlp.up_proj.weight")
            out = self._linear(act(gate) * up, p + "mlp.down_proj.weight")
            h = h + (self._rmsnorm(out, p + "post_feedforward_layernorm.weight") if spec.gemma else out)
        return h

    def logits(self, h: torch.Tensor, exact: bool = False) -> torch.Tensor:
        """The logits of hidden rows `h`; `exact` (fused CUDA layers): on
        kvhold.executor.cuda.gemm.exact_linear at any row count."""
        head = self.lm_head if self.lm_head.dtype == self.dtype else self.lm_head.to(self.dtype)
        if self.fused is not None:
            return self.fused.logits(h, head, exact=exact)
        logits = F.linear(self._rmsnorm(h, "model.norm.weight"), head)
        if (cap := self.spec.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _attention(self, layer: int, q: torch.Tensor, step: StepInput, kv: KvCache) -> torch.Tensor:
        out = torch.empty_like(q)
        window = self.spec.window(layer)
        for s in step.seqs:
            k, v = kv.gather(layer, s.pages, s.context, self.dtype)
            if self.group > 1:      # each kv head repeated for its query heads (repeat_interleave, one copy)
                k = k[:, :, None].expand(-1, -1, self.group, -1).reshape(s.context, -1, k.shape[-1])
                v = v[:, :, None].expand(-1, -1, self.group, -1).reshape(s.context, -1, v.shape[-1])
            qs = q[s.start:s.start + s.n]                               # [n, heads, dim]
            scores = torch.einsum("qhd,khd->hqk", qs, k) * self.scale
            if (cap := self.spec.attn_logit_softcap) is not None:
                scores = torch.tanh(scores / cap) * cap
            if s.n > 1 or window is not None:   # a decode row without a window sees every key
                first = s.context - s.n
                keys = torch.arange(s.context, device=q.device)[None, :]
                queries = (first + torch.arange(s.n, device=q.device))[:, None]
                allowed = keys <= queries
                if window is not None:
                    allowed &= keys > queries - window
                scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16)
                                  else scores, dim=-1).to(v.dtype)
            out[s.start:s.start + s.n] = torch.einsum("hqk,khd->qhd", probs, v)
        return out
