"""Checkpoints of the other supported model families, written without transformers.

`build_family(out, model_type)` writes a Hugging Face directory for `llama`, `mistral`,
`qwen2`, `qwen3` or `phi3` as transformers' `save_pretrained` names it: the family's
config.json keys and architecture, and its tensor names (Qwen2's q/k/v biases, Qwen3's
per-head `q_norm`/`k_norm`, Phi-3's single `qkv_proj` and `gate_up_proj`). It starts
from kvhold.testing.make_model's Llama checkpoint (same tokenizer, same seeded weights)
and gives the norms and biases random values, so that every family-specific tensor
changes the output. tests/unit/test_hf_parity.py loads these directories with
transformers and checks its outputs equal kvhold's; the GPU tests use them where
transformers is not installed.
"""
from __future__ import annotations

import json
from pathlib import Path

from kvhold.testing import make_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def build_family(out: Path, model_type: str, preset: str = "tiny", seed: int = 0,
                 dtype: str | None = None) -> Path:
    """Write a `model_type` checkpoint of `preset`'s shapes to `out` (`dtype`: the stored
    dtype, default the preset's)."""
    import torch
    from safetensors.torch import load_file, save_file

    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} not one of {FAMILIES}")
    out = make_model.build(Path(out), preset, seed, progress=False)
    cfg = json.loads((out / "config.json").read_text())
    files = sorted(out.glob("model*.safetensors"))
    if len(files) != 1:
        raise ValueError("build_family writes single-file checkpoints (a smaller preset)")
    w = load_file(str(files[0]))
    store = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype or cfg["torch_dtype"]]
    gen = torch.Generator().manual_seed(seed + 1)
    hd, layers = cfg["head_dim"], cfg["num_hidden_layers"]

    def around_one(n):
        return 1 + 0.2 * torch.randn(n, generator=gen)

    def small(n):
        return 0.2 * torch.randn(n, generator=gen)

    cfg.pop("rope_scaling", None)            # Llama 3's frequency scaling is Llama's own
    cfg.update(model_type=model_type, architectures=[_ARCH[model_type]], torch_dtype=dtype or cfg["torch_dtype"])
    for name in [n for n in w if n.endswith("norm.weight")]:
        w[name] = around_one(w[name].numel())
    for layer in range(layers):
        p = f"model.layers.{layer}.self_attn."
        m = f"model.layers.{layer}.mlp."
        if model_type == "qwen2":
            for x in "qkv":
                w[p + f"{x}_proj.bias"] = small(w[p + f"{x}_proj.weight"].shape[0])
        if model_type == "qwen3":
            w[p + "q_norm.weight"], w[p + "k_norm.weight"] = around_one(hd), around_one(hd)
        if model_type == "phi3":
            w[p + "qkv_proj.weight"] = torch.cat([w.pop(p + f"{x}_proj.weight") for x in "qkv"])
            w[m + "gate_up_proj.weight"] = torch.cat([w.pop(m + "gate_proj.weight"), w.pop(m + "up_proj.weight")])
    if model_type == "mistral":
        cfg["sliding_window"] = None
    if model_type in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=layers)
        cfg.pop("attention_bias", None)
        if model_type == "qwen3":
            cfg["attention_bias"] = False
    if model_type == "phi3":
        cfg.pop("head_dim", None)            # Phi-3's config derives it: hidden_size / heads
        if cfg["hidden_size"] // cfg["num_attention_heads"] != hd:
            raise ValueError("phi3 needs head_dim == hidden_size / num_attention_heads")
        cfg.update(sliding_window=None, pad_token_id=None, original_max_position_embeddings=cfg["max_position_embeddings"],
                   resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=1.0)
    save_file({k: v.to(store).contiguous() for k, v in w.items()}, str(files[0]), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    import argparse
    import sys

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=FAMILIES, help="the model family's checkpoint to write")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint directory to write")
    parser.add_argument("--preset", choices=sorted(make_model.PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_family(args.out, args.family, args.preset, args.seed)
    print(f"wrote a {args.family} checkpoint ({args.preset}) to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
