"""ModelSpec: what kvhold needs to know about a Llama-family checkpoint's config.json.

Shared by the sidecar (to size regions and tables, with no torch) and the engine.
Supports Llama 1-3 (including Llama-3 RoPE frequency scaling), Mistral (sliding-window
attention), Qwen2 (q/k/v bias, sliding windows on the layers transformers puts them on),
Qwen3 (RMSNorm of each query and key head), Phi-3 (fused q|k|v and gate|up tensors,
sliding window), Gemma 2 (`gemma2`: embeddings scaled by sqrt(hidden), RMSNorm weights
applied as 1 + w, a norm before and after both attention and MLP, GELU-tanh MLP,
query_pre_attn_scalar, attention and final logit soft-capping, sliding-window and global
layers alternating) and Gemma 3 text models (`gemma3_text`: as Gemma 2, with q/k RMSNorm
and its own RoPE base, `rope_local_base_freq`, on the sliding layers) configs in Hugging
Face format, including the `rope_parameters` spelling of newer transformers releases. The end-of-sequence ids are those of
config.json and generation_config.json together (as vLLM stops on both). What the
engine does not implement (other activations, partial rotary, other RoPE types,
other layer types) is refused with the reason, never ignored. A `quantization_config` is read
by kvhold.protocol.quantization: FP8 checkpoints (compressed-tensors, transformers' fp8) give
`quant`, which names the weights stored in float8_e4m3fn and their scale tensors; any other
scheme is refused.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from kvhold.protocol.quantization import Fp8Scheme, parse_quantization

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
# the fused CUDA layers (kvhold.executor.cuda.layers) implement these; the CPU engine all of them
CUDA_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
DTYPE_ALIASES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
                 "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


class CheckpointError(ValueError):
    """The checkpoint is missing a file or does not match its config."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str = "default"          # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # per layer: the number of positions a query attends to (itself included), None = all
    sliding_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"                 # the gated MLP's activation: silu | gelu_pytorch_tanh
    query_pre_attn_scalar: float | None = None   # attention scores scaled by this**-0.5, else head_dim**-0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Gemma 3: the RoPE of the sliding-window layers (base, scaling); None = the same as the others
    local_rope_theta: float | None = None
    local_rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # FP8 weights (kvhold.protocol.quantization); None: every tensor in a float dtype
    quant: Fp8Scheme | None = None

    @property
    def qk_norm(self) -> bool:
        """Qwen3, Gemma 3: an RMSNorm over each query and key head, before RoPE."""
        return self.model_type in ("qwen3", "gemma3_text")

    @property
    def gemma(self) -> bool:
        """Gemma 2/3: embeddings times sqrt(hidden_size), RMSNorm as x_hat * (1 + w) in float32,
        and a norm after attention and around the MLP too (pre/post_feedforward_layernorm)."""
        return self.model_type in GEMMA_MODEL_TYPES

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def rope(self, layer: int) -> tuple[float, RopeScaling]:
        """The RoPE base and scaling of `layer`: Gemma 3's sliding layers have their own."""
        if self.local_rope_theta is not None and self.window(layer) is not None:
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling

    @property
    def fused_tensors(self) -> bool:
        """Phi-3: q|k|v in one `qkv_proj` tensor and gate|up in one `gate_up_proj`."""
        return self.model_type == "phi3"

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def cuda_refusal(self, max_seq_len: int) -> str | None:
        """Why the CUDA engine cannot run this model with a context of `max_seq_len`, or None."""
        if self.model_type not in CUDA_MODEL_TYPES:
            return (f"model_type {self.model_type!r} runs on the CPU engine only (--device cpu); the CUDA "
                    f"engine's fused layers implement {', '.join(CUDA_MODEL_TYPES)}")
        windows = [w for w in self.sliding_windows if w is not None and w < max_seq_len]
        if windows:
            return (f"the model's sliding window of {min(windows)} positions is shorter than the context "
                    f"(--max-seq-len {max_seq_len}) and the CUDA attention attends over the whole context: "
                    f"use --max-seq-len {min(windows)} or less, or --device cpu")
        return None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing (a Hugging Face checkpoint needs config.json)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
        gen_path = Path(path) / "generation_config.json"
        gen = {}
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except json.JSONDecodeError as exc:
                raise CheckpointError(f"{gen_path}: not valid JSON ({exc})") from None
        try:
            spec = cls.from_config(cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{cfg_path}: {exc}") from None
        try:
            extra = _token_ids(gen.get("eos_token_id") if isinstance(gen, dict) else None)
        except ValueError as exc:
            raise CheckpointError(f"{gen_path}: {exc}") from None
        bad = [e for e in extra if not 0 <= e < spec.vocab_size]
        if bad:
            raise CheckpointError(f"{gen_path}: eos_token_id {bad} outside the vocabulary "
                                  f"(vocab_size {spec.vocab_size})")
        eos = spec.eos_token_ids + tuple(e for e in dict.fromkeys(extra) if e not in spec.eos_token_ids)
        return dataclasses.replace(spec, eos_token_ids=eos)

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelSpec":
        model_type = cfg.get("model_type", "llama")
        if model_type == "gemma3":
            raise ValueError("model_type 'gemma3' is Gemma 3's image-text model (its weights under "
                             "language_model.*): only the text model, model_type gemma3_text, is supported")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        if model_type in GEMMA_MODEL_TYPES:
            return _gemma_spec(cfg, model_type)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        raw_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        if raw_dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype {raw_dtype!r} is not supported")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (the MLP is SwiGLU: silu)")
        partial = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head)")
        eos_ids = tuple(dict.fromkeys(_token_ids(cfg.get("eos_token_id"))))
        spec = cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            dtype=DTYPE_ALIASES[raw_dtype],
            rope_scaling=_parse_scaling(scaling),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_windows=_sliding_windows(cfg, model_type),
            quant=parse_quantization(cfg),
        )
        spec.validate()
        return spec

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.sliding_windows)} layer types for {self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            raise ValueError(f"sliding_window must be positive, got {self.sliding_windows}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face tensor name -> shape, for this config."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h),
                                              "model.norm.weight": (h,)}
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        for layer in range(self.num_layers):
            p = f"model.layers.{layer}."
            shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
            if self.gemma:
                shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                               p + "post_feedforward_layernorm.weight": (h,)})
            if self.fused_tensors:
                shapes.update({p + "self_attn.qkv_proj.weight": (q + 2 * kv, h),
                               p + "self_attn.o_proj.weight": (h, q),
                               p + "mlp.gate_up_proj.weight": (2 * i, h),
                               p + "mlp.down_proj.weight": (h, i)})
            else:
                shapes.update({
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                })
            if self.qk_norm:
                shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,),
                               p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
            # a layer's scales after all its tensors: its FP8 q|k|v and gate|up stay adjacent
            for name in self.fp8_weights(layer):
                shapes.update({name.removesuffix("weight") + suffix: shape
                               for suffix, shape in self.quant.scale_shapes(shapes[name]).items()})
        return shapes

    def linear_weights(self, layer: int) -> tuple[str, ...]:
        """The names of `layer`'s Linear weights, in the region's order."""
        p = f"model.layers.{layer}."
        if self.fused_tensors:
            mods = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        else:
            mods = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        return tuple(p + m + ".weight" for m in mods)

    def fp8_weights(self, layer: int | None = None) -> tuple[str, ...]:
        """The weights stored in float8_e4m3fn (of `layer`, or of every layer)."""
        if self.quant is None:
            return ()
        layers = range(self.num_layers) if layer is None else (layer,)
        return tuple(n for i in layers for n in self.linear_weights(i)
                     if self.quant.quantized(n.removesuffix(".weight")))


def _token_ids(value) -> list[int]:
    """An `eos_token_id` field: an int, a list of ints, or absent."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
        raise ValueError(f"eos_token_id must be an integer or a list of integers, got {value!r}")
    return values


def _sliding_windows(cfg: dict, model_type: str) -> tuple[int | None, ...]:
    """Each layer's attention window, where transformers' model of this type applies one."""
    layers = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if model_type == "llama":          # LlamaAttention has no window
        return ()
    if model_type in ("mistral", "phi3"):  # one window on every layer (transformers ignores layer_types)
        return (int(window),) * layers if window is not None else ()
    # qwen2, qwen3: `layer_types`, else sliding layers from max_window_layers on when use_sliding_window
    if not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is None:
        start = int(cfg.get("max_window_layers", 28))
        types = ["sliding_attention" if window is not None and i >= start else "full_attention"
                 for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (full_attention, sliding_attention)")
    if window is None or "sliding_attention" not in types:   # transformers: no window then
        return ()
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


# transformers' defaults for what a Gemma config.json may leave out (Gemma2Config, Gemma3TextConfig)
_GEMMA_DEFAULTS = {
    "gemma2": dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=8192, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   rope_theta=10000.0, pattern=2),
    "gemma3_text": dict(head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072,
                        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
                        attn_logit_softcapping=None, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                        pattern=6),
}


def _gemma_spec(cfg: dict, model_type: str) -> "ModelSpec":
    """A Gemma 2 / Gemma 3 text config, read as transformers' Gemma2Config / Gemma3TextConfig do."""
    d = _GEMMA_DEFAULTS[model_type]

    def get(key):
        return cfg[key] if key in cfg else d[key]

    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {act!r} is not supported (Gemma's MLP: gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (the engine attends causally)")
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias is not supported for Gemma models")
    attn_cap = get("attn_logit_softcapping")
    if model_type == "gemma3_text" and attn_cap is not None:
        # Gemma3Attention never passes it to the attention: refused rather than guessed at
        raise ValueError(f"attn_logit_softcapping {attn_cap} is not supported for gemma3_text "
                         "(transformers' Gemma 3 does not apply it)")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:   # the older spelling: every `pattern`-th layer global, the others sliding
        pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", d["pattern"])))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported (full_attention, sliding_attention)")
    window = get("sliding_window")
    if window is None and "sliding_attention" in types:
        raise ValueError("sliding_attention layers need a sliding_window")
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)

    rope = cfg.get("rope_parameters") or {}
    local_theta, local_scaling = None, RopeScaling()
    if model_type == "gemma3_text":
        if "full_attention" in rope or "sliding_attention" in rope:     # newer: one set per layer type
            glob, loc = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
            theta = float(glob.get("rope_theta", d["rope_theta"]))
            local_theta = float(loc.get("rope_theta", d["rope_local_base_freq"]))
            glob_scaling = glob if glob.get("rope_type") not in (None, "default") else None
            local_scaling = _parse_scaling(loc if loc.get("rope_type") not in (None, "default") else None)
        else:   # older: rope_theta and rope_scaling for the global layers, rope_local_base_freq
            theta = float(cfg.get("rope_theta", rope.get("rope_theta", d["rope_theta"])))
            local_theta = float(cfg.get("rope_local_base_freq", d["rope_local_base_freq"]))
            glob_scaling = cfg.get("rope_scaling") or (
                rope if rope.get("rope_type") not in (None, "default") else None)
    else:
        theta = float(cfg.get("rope_theta", rope.get("rope_theta", d["rope_theta"])))
        glob_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
    raw_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if raw_dtype not in DTYPE_ALIASES:
        raise ValueError(f"dtype {raw_dtype!r} is not supported")
    heads = int(cfg["num_attention_heads"])
    final_cap = get("final_logit_softcapping")
    spec = ModelSpec(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(get("head_dim")),
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=theta,
        max_position=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        attention_bias=False,
        dtype=DTYPE_ALIASES[raw_dtype],
        rope_scaling=_parse_scaling(glob_scaling),
        bos_token_id=cfg.get("bos_token_id", 2),
        eos_token_ids=tuple(dict.fromkeys(_token_ids(cfg.get("eos_token_id", 1)))),
        sliding_windows=windows,
        hidden_act=act,
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
        attn_logit_softcap=None if attn_cap is None else float(attn_cap),
        final_logit_softcap=None if final_cap is None else float(final_cap),
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
        quant=parse_quantization(cfg),
    )
    spec.validate()
    return spec


def _parse_scaling(d: dict | None) -> RopeScaling:
    if not d:
        return RopeScaling()
    kind = d.get("rope_type") or d.get("type") or "default"
    if kind not in ("default", "llama3", "linear"):
        raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")
    return RopeScaling(kind=kind, factor=float(d.get("factor", 1.0)),
                       low_freq_factor=float(d.get("low_freq_factor", 1.0)),
                       high_freq_factor=float(d.get("high_freq_factor", 4.0)),
                       original_max_position=int(d.get("original_max_position_embeddings", 8192)))
