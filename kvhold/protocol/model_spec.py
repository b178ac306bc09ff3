"""ModelSpec: what kvhold needs to know about a Llama-family checkpoint's config.json.

Shared by the sidecar (to size regions and tables, with no torch) and the engine.
Supports Llama 1-3 (including Llama-3 RoPE frequency scaling), Mistral-style and
Qwen2-style (q/k/v bias) configs in Hugging Face format, including the
`rope_parameters` spelling of newer transformers releases.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
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

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path}: missing (a Hugging Face checkpoint needs config.json)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from None
        try:
            return cls.from_config(cfg)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{cfg_path}: {exc}") from None

    @classmethod
    def from_config(cls, cfg: dict) -> "ModelSpec":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type") not in (None, "default") else None)
        raw_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
        if raw_dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype {raw_dtype!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
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
            shapes.update({
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            })
            if self.attention_bias:
                shapes.update({p + "self_attn.q_proj.bias": (q,),
                               p + "self_attn.k_proj.bias": (kv,),
                               p + "self_attn.v_proj.bias": (kv,)})
        return shapes


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
