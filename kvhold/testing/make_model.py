"""Build Llama-architecture checkpoints locally: nothing is downloaded.

    python -m kvhold.testing.make_model --preset tiny --out DIR
    python -m kvhold.testing.make_model --preset llama3-8b --out DIR --device cuda   (random bf16, ~16 GB)
    python -m kvhold.testing.make_model --preset tiny --quant fp8-dynamic --out DIR
    python -m kvhold.testing.make_model --preset llama3-70b-fp8 --out DIR --device cuda   (FP8, ~73 GB)

Writes a Hugging Face style directory: config.json, model*.safetensors,
tokenizer.json (a byte-level BPE tokenizer trained here, by `tokenizers`, on a
deterministic synthetic corpus), tokenizer_config.json and generation_config.json.
A preset whose vocabulary is larger than the trained tokenizer's (llama3-8b: 128,256 ids,
as Llama 3) gets a tokenizer that covers every id (`covering_tokenizer`): a BPE of 512
tokens over the ASCII bytes (other bytes encode as `<unk>`), then plain vocabulary entries
`<|reserved_N|>` up to the model's vocabulary size. Every id but `<s>` and `</s>` then
decodes, alone or in any sequence, to its own non-empty text, so a stream of generated
ids is one text piece per token (a lone byte of a multi-byte character would decode to
nothing until its character completes; a special token to nothing at all).
Weights are random (seeded), so the text they produce is meaningless; what
matters to kvhold is that the shapes, the formats and the arithmetic are real.
`ensure_demo_model` builds the tiny preset once into a cache directory.

`--quant` writes an FP8 checkpoint as published ones are stored (kvhold.protocol.quantization):
every decoder Linear weight quantized to float8_e4m3fn with its scales, embeddings, norms and
lm_head left in the preset's dtype, and the `quantization_config` those checkpoints carry:
  fp8-dynamic  compressed-tensors "float-quantized", per-output-channel `weight_scale` [out, 1]
               (in the model's dtype), dynamic per-token activations (llm-compressor's FP8_DYNAMIC)
  fp8-tensor   compressed-tensors, one `weight_scale` [1] per weight and a static `input_scale`
               [1] per layer (llm-compressor's FP8; the input scale is a fixed 16/448 here, as
               there is no calibration data: the CPU engine does not use it)
  fp8-block    transformers' fp8 with `weight_block_size` [128, 128]: `weight_scale_inv`
               [ceil(out/128), ceil(in/128)] in float32, dynamic activations (DeepSeek-V3's, Qwen3's)
A scale is amax / 448 of its channel, tensor or block, stored first and then used to quantize,
so dequantizing (weight * stored scale) reproduces the drawn weight to FP8's precision. The
`llama3-70b-fp8` preset (Llama-3-70B's shapes) is fp8-dynamic: each tensor is drawn and
quantized on `--device`, and shards are written as they fill (`--shard-gb`), so the bf16
model is never whole in memory; about 73 GB on disk. `--layers N` keeps a preset's shapes with
N layers.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

PRESETS = {
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, vocab_size=None,
                 rope_theta=10000.0, torch_dtype="float32",
                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      max_position_embeddings=131072, vocab_size=128256, rope_theta=500000.0,
                      torch_dtype="bfloat16",
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
PRESETS["llama3-8b-4l"] = dict(PRESETS["llama3-8b"], num_hidden_layers=4)  # same shapes, fewer layers
PRESETS["llama3-70b-fp8"] = dict(PRESETS["llama3-8b"], hidden_size=8192, intermediate_size=28672,
                                 num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
PRESET_QUANT = {"llama3-70b-fp8": "fp8-dynamic"}     # presets written in FP8 whatever --quant says
QUANT_KINDS = ("fp8-dynamic", "fp8-tensor", "fp8-block")
STATIC_INPUT_SCALE = 16.0 / 448.0        # fp8-tensor's input_scale: activations up to |16| in range
PRESETS["llama3-tiny"] = dict(PRESETS["tiny"], vocab_size=4096)  # tiny shapes, llama3-8b's kind of tokenizer
DEMO_VERSION = "tiny-v1"
WORDS = ("the a an of to in and or but with for on at by from over under about after before "
         "sidecar executor memory page cache token request stream crash recover journal lease "
         "epoch fence standby active model weight layer head attention kernel device host "
         "quick brown fox jumps lazy dog river mountain forest city light dark blue green red "
         "small large fast slow old new early late first last always never often sometimes "
         "write read copy check seal commit resume continue restart serve answer question "
         "one two three four five six seven eight nine ten hundred thousand").split()
SPECIAL = ["<s>", "</s>"]
UNK = "<unk>"
RESERVED = "<|reserved_{}|>"


def synthetic_corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rng.randint(4, 14)
        sentence = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(sentence.capitalize() + rng.choice([".", ".", "!", "?", ","]))
    return out


def _byte_char(b: int) -> str:
    """The character byte-level BPE writes byte `b` as (GPT-2's table, which `tokenizers` uses)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def train_tokenizer(vocab_size: int = 512, ascii_only: bool = False):
    """A byte-level BPE trained on the synthetic corpus. `ascii_only`: its alphabet is the 128
    ASCII bytes and any other byte encodes as `<unk>` (a plain token, not a special one), so
    that no token is a fragment of a character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True) if ascii_only else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [_byte_char(b) for b in range(128)] if ascii_only else pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL + ([UNK] if ascii_only else []),
                                  show_progress=False, initial_alphabet=alphabet)
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    if ascii_only:      # <unk> stays in the model's vocabulary, decoded as its text
        data = json.loads(tok.to_str())
        data["added_tokens"] = [a for a in data["added_tokens"] if a["content"] != UNK]
        tok = Tokenizer.from_str(json.dumps(data))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    return tok


def covering_tokenizer(vocab_size: int, base_size: int = 512):
    """A tokenizer with exactly `vocab_size` ids, each of which decodes to text: the ASCII BPE of
    `base_size` tokens, then plain vocabulary entries `<|reserved_N|>` (N the id) up to
    `vocab_size`. No merge builds them, so encoding never produces them; decoding writes their
    names (Llama 3 fills its vocabulary with reserved tokens too, special ones there)."""
    from tokenizers import Tokenizer

    if vocab_size < base_size:
        raise ValueError(f"a vocabulary of {vocab_size} is smaller than the base BPE's {base_size}")
    data = json.loads(train_tokenizer(base_size, ascii_only=True).to_str())
    vocab = data["model"]["vocab"]
    if len(vocab) != base_size:
        raise RuntimeError(f"the trained BPE has {len(vocab)} tokens, not {base_size}")
    vocab.update((RESERVED.format(i), i) for i in range(base_size, vocab_size))
    return Tokenizer.from_str(json.dumps(data))


def tokenizer_for(preset: str, vocab_size: int | None = None):
    """The tokenizer a preset's checkpoint gets: the 512-token BPE, or one covering the
    preset's whole vocabulary (`vocab_size`, where given, instead of the preset's)."""
    vocab_size = vocab_size or PRESETS[preset]["vocab_size"]
    return covering_tokenizer(vocab_size) if vocab_size else train_tokenizer()


def quantization_config(quant: str) -> dict:
    """The `quantization_config` of a `quant` kind, as published checkpoints of that kind have it."""
    def ct_args(strategy, dynamic, observer):
        return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": None,
                "num_bits": 8, "observer": observer, "observer_kwargs": {}, "strategy": strategy,
                "symmetric": True, "type": "float"}
    if quant == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    if quant not in ("fp8-dynamic", "fp8-tensor"):
        raise ValueError(f"unknown quant {quant!r} (one of {', '.join(QUANT_KINDS)})")
    dynamic = quant == "fp8-dynamic"
    group = {"input_activations": ct_args("token" if dynamic else "tensor", dynamic, None if dynamic else "minmax"),
             "output_activations": None, "targets": ["Linear"],
             "weights": ct_args("channel" if dynamic else "tensor", False, "minmax")}
    return {"config_groups": {"group_0": group}, "format": "float-quantized", "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def make_config(preset: str, vocab_size: int, bos: int, eos: int, quant: str | None = None,
                overrides: dict | None = None) -> dict:
    """The preset's config.json (with `overrides` of its fields); `quant`: an FP8 kind's
    quantization_config (a preset of PRESET_QUANT always has its own)."""
    cfg = dict(PRESETS[preset], **(overrides or {}))
    cfg["vocab_size"] = cfg["vocab_size"] or vocab_size
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
               bos_token_id=bos, eos_token_id=eos)
    quant = PRESET_QUANT.get(preset, quant)
    if quant is not None:
        cfg["quantization_config"] = quantization_config(quant)
    return cfg


def quantize_fp8(w, quant: str, scale_dtype):
    """(float8_e4m3fn weight, {scale suffix: scale}) of a float weight [out, in] for a `quant`
    kind: each scale amax / 448 over its channel, tensor or 128x128 block, stored in
    `scale_dtype` (fp8-block: float32) and used as stored."""
    import torch

    from kvhold.protocol.quantization import FP8_MAX

    wf = w.float()
    out, inp = wf.shape
    if quant == "fp8-block":
        b = 128
        ob, ib = -(-out // b), -(-inp // b)
        padded = torch.zeros(ob * b, ib * b, device=wf.device)
        padded[:out, :inp] = wf.abs()
        amax = padded.view(ob, b, ib, b).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12).to(torch.float32)
        full = scale.repeat_interleave(b, 0)[:out].repeat_interleave(b, 1)[:, :inp]
        name = "weight_scale_inv"
    elif quant == "fp8-dynamic":
        scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        full, name = scale.float(), "weight_scale"
    else:
        scale = (wf.abs().amax().reshape(1) / FP8_MAX).clamp(min=1e-12).to(scale_dtype)
        full, name = scale.float(), "weight_scale"
    q = (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    scales = {name: scale}
    if quant == "fp8-tensor":
        scales["input_scale"] = torch.tensor([STATIC_INPUT_SCALE], dtype=scale_dtype, device=wf.device)
    return q, scales


def checkpoint_tensors(cfg: dict, seed: int, device: str = "cpu"):
    """Yield (name, tensor) of the checkpoint `cfg` describes: random_weights, each decoder
    Linear weight quantized (with its scales after it) where cfg has a quantization_config."""
    import torch

    quant = _quant_kind(cfg)
    scale_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["torch_dtype"]]
    for name, tensor in random_weights(cfg, seed, device):
        if quant is None or not (name.startswith("model.layers.") and name.endswith("_proj.weight")):
            yield name, tensor
            continue
        q, scales = quantize_fp8(tensor, quant, scale_dtype)
        yield name, q
        for suffix, scale in scales.items():
            yield name.removesuffix("weight") + suffix, scale


def _quant_kind(cfg: dict) -> str | None:
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if q.get("quant_method") == "fp8":
        return "fp8-block"
    return "fp8-dynamic" if q["config_groups"]["group_0"]["weights"]["strategy"] == "channel" else "fp8-tensor"


def random_weights(cfg: dict, seed: int, device: str = "cpu"):
    """Yield (name, tensor) in a seeded, deterministic order."""
    import torch

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg["torch_dtype"]]
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv, v = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["vocab_size"]

    def normal(shape, std):
        return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    yield "model.embed_tokens.weight", normal((v, h), 1.0)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "input_layernorm.weight", torch.ones(h, dtype=dtype, device=device)
        yield p + "post_attention_layernorm.weight", torch.ones(h, dtype=dtype, device=device)
        yield p + "self_attn.q_proj.weight", normal((q, h), h ** -0.5)
        yield p + "self_attn.k_proj.weight", normal((kv, h), h ** -0.5)
        yield p + "self_attn.v_proj.weight", normal((kv, h), h ** -0.5)
        yield p + "self_attn.o_proj.weight", normal((h, q), q ** -0.5)
        yield p + "mlp.gate_proj.weight", normal((i, h), h ** -0.5)
        yield p + "mlp.up_proj.weight", normal((i, h), h ** -0.5)
        yield p + "mlp.down_proj.weight", normal((h, i), i ** -0.5)
    yield "model.norm.weight", torch.ones(h, dtype=dtype, device=device)
    yield "lm_head.weight", normal((v, h), h ** -0.5)


def build(out: Path, preset: str = "tiny", seed: int = 0, device: str = "cpu",
          shard_bytes: int = 4 << 30, progress: bool = True, quant: str | None = None,
          overrides: dict | None = None, spill: Path | None = None) -> Path:
    """Write a checkpoint to `out` atomically (a temp dir beside it, renamed at the end; its
    parent folders are made first). `spill`: a folder on another file system for the shards that
    no longer fit beside `out` (each linked from the checkpoint's folder, which loads as one: a
    70B checkpoint is larger than a GPU machine's /dev/shm or its disk alone). `progress`: say on stderr what it does (the tokenizer's
    training and the weights take tens of seconds on a small machine). `quant`: an FP8 kind
    (QUANT_KINDS); `overrides`: config fields instead of the preset's. Each shard is written
    as soon as it holds `shard_bytes`; several shards get a model.safetensors.index.json."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    if quant is not None and quant not in QUANT_KINDS:
        raise ValueError(f"unknown quant {quant!r} (one of {', '.join(QUANT_KINDS)})")
    if preset in PRESET_QUANT and quant not in (None, PRESET_QUANT[preset]):
        raise ValueError(f"preset {preset} is {PRESET_QUANT[preset]}; --quant {quant} does not apply to it")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kvhold-model-", dir=out.parent))
    spilled: list[Path] = []
    try:
        vocab = (overrides or {}).get("vocab_size") or PRESETS[preset]["vocab_size"]
        say(f"  {preset}: training the BPE tokenizer" if not vocab else f"  {preset}: making the tokenizer")
        tok = tokenizer_for(preset, vocab)
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        cfg = make_config(preset, tok.get_vocab_size(), bos, eos, quant, overrides)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos}) + "\n")
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
             "model_max_length": cfg["max_position_embeddings"]}) + "\n")
        kind = _quant_kind(cfg)
        say(f"  {preset}: drawing random weights ({cfg['num_hidden_layers']} layers, hidden size "
            f"{cfg['hidden_size']}, vocabulary {cfg['vocab_size']}) on {device}"
            + (f", quantized {kind}" if kind else ""))
        shard, size, parts, weight_map, total = {}, 0, [], {}, 0
        expected, t0 = _checkpoint_bytes(cfg), time.monotonic()

        def flush(nbytes: int):
            part = tmp / f".part-{len(parts):05d}.safetensors"
            if spill is not None and shutil.disk_usage(tmp).free < nbytes + (1 << 30):
                Path(spill).mkdir(parents=True, exist_ok=True)
                target = Path(spill).resolve() / f"{tmp.name}{part.name}"
                spilled.append(target)          # first, so that a write cut short is removed too
                save_file(shard, str(target), metadata={"format": "pt"})
                part.symlink_to(target)
            else:
                save_file(shard, str(part), metadata={"format": "pt"})
            parts.append((part, list(shard)))
            shard.clear()
            if progress and (len(parts) > 1 or expected > shard_bytes):   # a line per shard, if several
                bar.write(f"  shard {len(parts)} written: {total / 1e9:.2f} of {expected / 1e9:.2f} GB "
                          f"({100 * total / expected:.0f}%), {time.monotonic() - t0:.0f} s", file=sys.stderr)

        # a bar on a terminal; the shard lines above in a log
        with tqdm(total=expected, unit="B", unit_scale=True, desc="writing weights",
                  disable=not progress or None, mininterval=1.0, file=sys.stderr) as bar:
            for name, tensor in checkpoint_tensors(cfg, seed, device):
                nbytes = tensor.numel() * tensor.element_size()
                shard[name] = tensor.to("cpu").contiguous()
                size += nbytes
                total += nbytes
                bar.update(nbytes)
                if size >= shard_bytes:
                    flush(size)
                    size = 0
            if shard or not parts:
                flush(size)
        for n, (part, names) in enumerate(parts):
            name = "model.safetensors" if len(parts) == 1 else f"model-{n + 1:05d}-of-{len(parts):05d}.safetensors"
            part.rename(tmp / name)
            weight_map.update((t, name) for t in names)
            say(f"  wrote {name}")
        if len(parts) > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        if out.exists():
            for link in (p for p in out.iterdir() if p.is_symlink()):   # an earlier build's spilled shards
                link.resolve().unlink(missing_ok=True)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for path in spilled:
            path.unlink(missing_ok=True)
        raise
    if spilled:
        say(f"  {len(spilled)} shard(s) spilled to {spill}, linked from {out}")
    return out


def _checkpoint_bytes(cfg: dict) -> int:
    """The bytes of the tensors checkpoint_tensors(cfg) yields, from the config alone."""
    from kvhold.protocol.model_spec import ModelSpec

    spec = ModelSpec.from_config(cfg)
    fp8 = set(spec.fp8_weights())
    item = 4 if cfg["torch_dtype"] == "float32" else 2
    scale_item = 4 if _quant_kind(cfg) == "fp8-block" else item
    total = 0
    for name, shape in spec.expected_tensors().items():
        n = 1
        for d in shape:
            n *= d
        scale = name.endswith(("_scale", "_scale_inv"))
        total += max(n, 1) * (1 if name in fp8 else scale_item if scale else item)
    return total


def default_cache_dir() -> Path:
    return Path(os.environ.get("KVHOLD_CACHE", Path.home() / ".cache" / "kvhold"))


def ensure_demo_model(cache_dir: Path | None = None, progress: bool = False) -> tuple[Path, bool]:
    """The tiny demo checkpoint, built once. Returns (path, built_now)."""
    path = Path(cache_dir or default_cache_dir()) / DEMO_VERSION
    if (path / "config.json").is_file() and list(path.glob("*.safetensors")):
        return path, False
    if progress:
        print(f"building the demo checkpoint in {path} (once; about half a minute on 2 cores)",
              file=sys.stderr, flush=True)
    return build(path, "tiny", progress=progress), True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to draw (and quantize) the random weights")
    parser.add_argument("--quant", choices=QUANT_KINDS, default=None,
                        help="write FP8 weights in this published format (see the module's docstring)")
    parser.add_argument("--layers", type=int, default=None, help="the preset's shapes with this many layers")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="the size a shard is written at")
    parser.add_argument("--spill-dir", type=Path, default=None,
                        help="where shards go once --out's file system has no room for the next (linked from --out)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be at least 1")
    overrides = {"num_hidden_layers": args.layers} if args.layers else None
    try:
        path = build(args.out, args.preset, args.seed, args.device, shard_bytes=int(args.shard_gb * 2**30),
                     quant=args.quant, overrides=overrides, spill=args.spill_dir)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
