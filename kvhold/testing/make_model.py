"""Build Llama-architecture checkpoints locally: nothing is downloaded.

    python -m kvhold.testing.make_model --preset tiny --out DIR
    python -m kvhold.testing.make_model --preset llama3-8b --out DIR --device cuda   (random bf16, ~16 GB)

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
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
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


def tokenizer_for(preset: str):
    """The tokenizer a preset's checkpoint gets: the 512-token BPE, or one covering the
    preset's whole vocabulary."""
    vocab_size = PRESETS[preset]["vocab_size"]
    return covering_tokenizer(vocab_size) if vocab_size else train_tokenizer()


def make_config(preset: str, vocab_size: int, bos: int, eos: int) -> dict:
    cfg = dict(PRESETS[preset])
    cfg["vocab_size"] = cfg["vocab_size"] or vocab_size
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
               rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
               bos_token_id=bos, eos_token_id=eos)
    return cfg


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
          shard_bytes: int = 4 << 30, progress: bool = True) -> Path:
    """Write a checkpoint to `out` atomically (a temp dir beside it, renamed at the end; its
    parent folders are made first). `progress`: say on stderr what it does (the tokenizer's
    training and the weights take tens of seconds on a small machine)."""
    from safetensors.torch import save_file

    def say(text: str) -> None:
        if progress:
            print(text, file=sys.stderr, flush=True)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".kvhold-model-", dir=out.parent))
    try:
        say(f"  {preset}: training the BPE tokenizer" if not PRESETS[preset]["vocab_size"]
            else f"  {preset}: making the tokenizer")
        tok = tokenizer_for(preset)
        bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        cfg = make_config(preset, tok.get_vocab_size(), bos, eos)
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": bos, "eos_token_id": eos}) + "\n")
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast",
             "model_max_length": cfg["max_position_embeddings"]}) + "\n")
        shard, size, shards = {}, 0, []
        say(f"  {preset}: drawing random weights ({cfg['num_hidden_layers']} layers, hidden size "
            f"{cfg['hidden_size']}, vocabulary {cfg['vocab_size']}) on {device}")
        for name, tensor in random_weights(cfg, seed, device):
            shard[name] = tensor.cpu().contiguous()
            size += tensor.numel() * tensor.element_size()
            if size >= shard_bytes:
                shards.append(shard)
                shard, size = {}, 0
        if shard:
            shards.append(shard)
        for n, part in enumerate(shards):
            name = "model.safetensors" if len(shards) == 1 else f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(part, str(tmp / name), metadata={"format": "pt"})
            say(f"  wrote {name}")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


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
    parser.add_argument("--device", default="cpu", help="where to draw the random weights")
    args = parser.parse_args(argv)
    path = build(args.out, args.preset, args.seed, args.device)
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
