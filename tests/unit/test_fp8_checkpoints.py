"""FP8 checkpoints as published ones store them, made here by make_model --quant: the config's
scheme read (compressed-tensors per-channel and per-tensor, transformers' fp8 with 128x128
blocks), the weights kept float8_e4m3fn with their scales in the sidecar's region, the CPU
engine's logits those of a float64 forward of the dequantized model (dequantized here, by the
formats' definitions, not by the engine's code), its greedy tokens the reference's, and every
other scheme refused with its name."""
import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvhold.executor.fp8 import Fp8Weight, quantize_rows, scaled_mm_linear
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput
from kvhold.executor.weights import WeightsRegion
from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.layout import KvGeometry
from kvhold.protocol.memory import HostRegion
from kvhold.protocol.model_spec import CheckpointError, ModelSpec
from kvhold.protocol.quantization import parse_quantization
from kvhold.sidecar.config import PoolConfig, SettingError, SidecarConfig
from kvhold.testing import make_model
from kvhold.testing.make_model import PRESETS, build, make_config, random_weights

QUANTS = ("fp8-dynamic", "fp8-tensor", "fp8-block")
# tiny shapes in bf16 (as published FP8 checkpoints are), a BPE of 512 tokens
SHAPES = dict(torch_dtype="bfloat16")
PAGE = 4
PROMPT = [1, 37, 250, 11, 402, 98, 7, 301, 55, 4, 190, 66, 23]
NEW = 12


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    out = {q: build(root / q, "tiny", quant=q, overrides=SHAPES, progress=False) for q in QUANTS}
    out["bf16"] = build(root / "bf16", "tiny", overrides=SHAPES, progress=False)
    return out


def _region(path):
    """The checkpoint loaded into a host region as the sidecar's loader does (sealed)."""
    manifest = build_manifest(path, ModelSpec.from_dir(path))
    shm = HostRegion(f"/kvhold-test-fp8-{os.getpid()}-{path.name}", "weights", manifest.region_bytes)
    region = WeightsRegion(shm.map_local(), manifest, path)
    region.load()
    return region, shm


def _dequantized(path) -> dict[str, torch.Tensor]:
    """Every tensor in float64, the FP8 ones dequantized by the formats' definitions."""
    raw = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in raw.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype != torch.float8_e4m3fn:
            out[name] = t.double()
            continue
        w = t.double()
        base = name.removesuffix("weight")
        if base + "weight_scale_inv" in raw:          # per 128x128 block, written out block by block
            s = raw[base + "weight_scale_inv"].double()
            for i in range(s.shape[0]):
                for j in range(s.shape[1]):
                    w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] *= s[i, j]
        else:
            s = raw[base + "weight_scale"].double()
            w = w * (s if s.dim() == 2 else s.reshape(()))     # [out, 1] per channel, [1] per tensor
        out[name] = w
    return out


def _greedy_logits(spec, model, dtype, n=NEW):
    """Prefill PROMPT, then one token per step (greedy) over a paged pool; the logits of every
    prompt position and of each decode step, and the tokens."""
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                    str(dtype).removeprefix("torch."), PAGE), 32)
    pages = torch.arange(1, 32)
    done, ids, rows, tokens = 0, PROMPT, [], []
    for _ in range(n + 1):
        end = done + len(ids)
        pos = torch.arange(done, end)
        step = StepInput(token_ids=torch.tensor(ids), positions=pos, write_pages=pages[pos // PAGE],
                         write_slots=pos % PAGE, seqs=[SeqSlice(0, len(ids), end, pages[:(end + PAGE - 1) // PAGE])],
                         logits_rows=torch.arange(len(ids)))
        logits = model.forward(step, kv)
        rows.append(logits.double())
        done = end
        ids = [int(logits[-1].argmax())]
        tokens.append(ids[0])
    return torch.cat(rows), tokens[:n]


@pytest.mark.parametrize("quant", QUANTS)
def test_the_loader_reads_each_format_and_keeps_fp8_in_the_region(ckpts, quant):
    path = ckpts[quant]
    spec = ModelSpec.from_dir(path)
    want = {"fp8-dynamic": ("compressed-tensors", "channel", "dynamic", None),
            "fp8-tensor": ("compressed-tensors", "tensor", "static", None),
            "fp8-block": ("fp8", "block", "dynamic", (128, 128))}[quant]
    assert (spec.quant.method, spec.quant.strategy, spec.quant.activation, spec.quant.block) == want
    assert len(spec.fp8_weights()) == 7 * spec.num_layers
    region, shm = _region(path)
    try:
        views = region.tensors()
        raw = load_file(str(path / "model.safetensors"))
        for name in spec.fp8_weights():
            assert views[name].dtype == torch.float8_e4m3fn
            assert torch.equal(views[name].view(torch.uint8), raw[name].view(torch.uint8))
        for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
            assert views[name].dtype == torch.bfloat16
        scale = {"fp8-dynamic": (64, 1), "fp8-tensor": (1,), "fp8-block": (1, 1)}[quant]
        suffix = "weight_scale_inv" if quant == "fp8-block" else "weight_scale"
        assert tuple(views[f"model.layers.0.self_attn.k_proj.{suffix}"].shape) == scale
        assert ("model.layers.0.mlp.down_proj.input_scale" in views) == (quant == "fp8-tensor")
    finally:
        shm.unlink()


def test_the_region_is_about_half_of_bf16s_and_its_fingerprint_covers_the_scheme(ckpts, tmp_path):
    bf16 = build_manifest(ckpts["bf16"], ModelSpec.from_dir(ckpts["bf16"]))
    prints = {bf16.fingerprint}
    for quant in QUANTS:
        spec = ModelSpec.from_dir(ckpts[quant])
        m = build_manifest(ckpts[quant], spec)
        fp8, full = m.by_name(), bf16.by_name()
        for name in spec.fp8_weights():
            assert fp8[name].dtype == "float8_e4m3fn" and fp8[name].nbytes * 2 == full[name].nbytes
        assert 0.5 < m.region_bytes / bf16.region_bytes < 0.6     # embeddings and lm_head stay bf16
        prints.add(m.fingerprint)
    assert len(prints) == 4
    # the same tensors under another activation scheme (weight-only): another fingerprint
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((ckpts["fp8-dynamic"] / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["input_activations"] = None
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.safetensors").symlink_to(ckpts["fp8-dynamic"] / "model.safetensors")
    assert build_manifest(other, ModelSpec.from_dir(other)).fingerprint not in prints


@pytest.mark.parametrize("quant", QUANTS)
def test_dequantized_weights_are_the_drawn_weights_to_fp8_precision(ckpts, quant):
    cfg = json.loads((ckpts[quant] / "config.json").read_text())
    drawn = dict(random_weights(cfg, 0))
    deq = _dequantized(ckpts[quant])
    name = "model.layers.1.mlp.down_proj.weight"
    orig, got = drawn[name].double(), deq[name]
    # e4m3: 3 fraction bits (half an ulp: 1/16 relative), subnormals 2^-9 apart, times the scale
    scale_bound = orig.abs().max() / 448
    assert ((got - orig).abs() <= orig.abs() / 16 + scale_bound * 2 ** -9).all()
    assert (got - orig).abs().max() > 0        # it was quantized


@pytest.mark.parametrize("quant", QUANTS)
def test_engine_logits_and_greedy_tokens_match_a_float64_forward_of_the_dequantized_model(ckpts, quant):
    path = ckpts[quant]
    spec = ModelSpec.from_dir(path)
    reference = LlamaModel(dataclasses.replace(spec, quant=None), _dequantized(path), torch.float64,
                           torch.device("cpu"), 64)
    want_logits, want_tokens = _greedy_logits(spec, reference, torch.float64)
    assert len(set(want_tokens)) > 2          # the comparison means something
    region, shm = _region(path)
    try:
        for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-3)):
            model = LlamaModel(spec, region.tensors(), dtype, torch.device("cpu"), 64)
            got_logits, got_tokens = _greedy_logits(spec, model, dtype)
            assert got_tokens == want_tokens
            err = (got_logits - want_logits).abs().max() / want_logits.abs().max()
            assert err < tol, (dtype, float(err))
    finally:
        shm.unlink()


def test_fp8_logits_are_the_float_models_within_fp8_error(ckpts):
    """The FP8 model is the drawn float model, quantized: its logits stay near the float model's."""
    path = ckpts["fp8-dynamic"]
    spec = ModelSpec.from_dir(path)
    cfg = json.loads((path / "config.json").read_text())
    drawn = {k: v.double() for k, v in random_weights(cfg, 0)}
    full = LlamaModel(dataclasses.replace(spec, quant=None), drawn, torch.float64, torch.device("cpu"), 64)
    fp8 = LlamaModel(spec, load_file(str(path / "model.safetensors")), torch.float64, torch.device("cpu"), 64)
    a, _ = _greedy_logits(spec, full, torch.float64, 1)
    b, _ = _greedy_logits(spec, fp8, torch.float64, 1)
    rel = (a - b).norm() / a.norm()
    assert 0 < rel < 0.1, float(rel)


REFUSED = [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "activation_scheme 'static'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
]


def _ct(weights=None, acts="dynamic", **top):
    w = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
         "group_size": None}
    w.update(weights or {})
    a = None if acts is None else {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                   "dynamic": True, "group_size": None}
    if isinstance(acts, dict):
        a.update(acts)
    q = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": a}}}
    q.update(top)
    return q


REFUSED += [
    (_ct({"type": "int"}, format="int-quantized"), "format 'int-quantized'"),
    (_ct({"type": "int"}), "num_bits=8 type=int strategy=channel"),
    (_ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}), "num_bits=4 type=int strategy=group"),
    (_ct({"strategy": "group", "group_size": 128}), "num_bits=8 type=float strategy=group"),
    (_ct({"strategy": "block", "block_structure": [128, 128]}), "strategy=block"),
    (_ct(acts={"strategy": "group", "group_size": 128}), "strategy=group dynamic=True"),
    (_ct(acts={"dynamic": False, "strategy": "token"}), "strategy=token dynamic=False"),
    (_ct(format="pack-quantized"), "format 'pack-quantized'"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    (_ct(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     "sparsity_config format 'sparse-24-bitmask'"),
    (_ct(transform_config={"config_groups": {}}), "transform_config"),
]


@pytest.mark.parametrize("qcfg,named", REFUSED, ids=[n for _, n in REFUSED])
def test_unsupported_schemes_are_refused_with_their_name(ckpts, tmp_path, qcfg, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        parse_quantization({"quantization_config": qcfg})
    cfg = json.loads((ckpts["fp8-dynamic"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, quantization_config=qcfg)))
    with pytest.raises(CheckpointError, match="config.json: .*" + named.replace("(", r"\(").replace("[", r"\[")):
        ModelSpec.from_dir(tmp_path)


def test_fp8_tensors_without_a_quantization_config_are_refused_not_loaded_as_floats(ckpts, tmp_path):
    cfg = json.loads((ckpts["fp8-block"] / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(str(ckpts["fp8-block"] / "model.safetensors")).items()
               if not k.endswith("scale_inv")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="dtype F8_E4M3, but the config does not quantize it"):
        build_manifest(tmp_path, ModelSpec.from_dir(tmp_path))
    # a quantized weight stored in bf16 is refused too
    (tmp_path / "config.json").write_text((ckpts["fp8-block"] / "config.json").read_text())
    tensors = load_file(str(ckpts["fp8-block"] / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj.weight'?: dtype BF16, but the config's quantization_config"):
        build_manifest(tmp_path, ModelSpec.from_dir(tmp_path))


def test_ignored_modules_stay_float():
    q = parse_quantization({"quantization_config": _ct(ignore=["lm_head", "re:.*mlp\\.down_proj$"])})
    assert q.quantized("model.layers.3.mlp.up_proj")
    assert not q.quantized("model.layers.3.mlp.down_proj") and not q.quantized("lm_head")
    hf = parse_quantization({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                     "modules_to_not_convert": ["self_attn.o_proj"]}})
    assert not hf.quantized("model.layers.0.self_attn.o_proj") and hf.quantized("model.layers.0.self_attn.q_proj")
    spec = ModelSpec.from_config(dict(make_config("tiny", 512, 0, 1, "fp8-dynamic"),
                                      quantization_config=_ct(ignore=["lm_head", "re:.*down_proj"])))
    assert len(spec.fp8_weights()) == 6 * spec.num_layers
    assert "model.layers.0.mlp.down_proj.weight_scale" not in spec.expected_tensors()
    assert tuple(spec.expected_tensors()["model.layers.0.mlp.up_proj.weight_scale"]) == (384, 1)


def test_dynamic_row_quantization_is_per_row_and_scaled_mm_matches_the_dequantized_product():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 64, generator=g) * torch.logspace(-2, 1, 9)[:, None]
    q, s = quantize_rows(x)
    for i in range(9):          # a row's FP8 values and scale are its own, whatever rows it is with
        qi, si = quantize_rows(x[i:i + 1])
        assert torch.equal(qi.view(torch.uint8), q[i:i + 1].view(torch.uint8)) and torch.equal(si, s[i:i + 1])
    w = torch.randn(48, 64, generator=g) / 8
    from kvhold.testing.make_model import quantize_fp8

    wq, scales = quantize_fp8(w, "fp8-dynamic", torch.float32)
    fw = Fp8Weight("w", wq, scales["weight_scale"], "channel")
    ref = x.double() @ fw.dequantize(torch.float64).T
    got = scaled_mm_linear(x.to(torch.bfloat16), fw).double()     # torch._scaled_mm: here on CPU
    assert ((got - ref).abs() / ref.abs().amax(dim=1, keepdim=True)).max() < 0.08
    # per-tensor weight scale, static input scale: rows within its range (|x| <= 16; not the last)
    wq, scales = quantize_fp8(w, "fp8-tensor", torch.float32)
    fw = Fp8Weight("w", wq, scales["weight_scale"], "tensor", input_scale=scales["input_scale"])
    ref = x.double() @ fw.dequantize(torch.float64).T
    got = scaled_mm_linear(x.to(torch.bfloat16), fw).double()
    assert ((got - ref).abs() / ref.abs().amax(dim=1, keepdim=True))[:-1].max() < 0.08   # rows in range


def test_the_70b_preset_fits_one_h200_and_its_reduced_build_is_sharded_fp8(ckpts, tmp_path, capsys):
    cfg = make_config("llama3-70b-fp8", 128256, 1, 2)
    spec = ModelSpec.from_config(cfg)
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.intermediate_size,
            spec.vocab_size, spec.rope_theta) == (8192, 80, 64, 8, 28672, 128256, 500000.0)
    assert spec.quant.strategy == "channel" and spec.quant.activation == "dynamic"
    assert make_model._checkpoint_bytes(cfg) / 1e9 == pytest.approx(72.7, abs=0.2)     # FP8 + bf16 head
    # on one H200 (about 139 GiB) at --gpu-memory-utilization 0.9 the FP8 weights leave room for KV;
    # the same model in bf16 would not fit at all
    pool = PoolConfig(model=ckpts["fp8-dynamic"], backend="cuda", device="cuda:0", gpu_memory_utilization=0.9,
                      compute_dtype="bfloat16")
    kv = SidecarConfig(pool=pool).kv_bytes_for_utilization(spec, total_bytes=139 << 30)
    assert kv > 45 << 30          # over 150,000 tokens of Llama-3-70B's KV (320 KiB a token)
    with pytest.raises(SettingError, match="leaves no KV memory"):
        SidecarConfig(pool=pool).kv_bytes_for_utilization(dataclasses.replace(spec, quant=None),
                                                          total_bytes=139 << 30)
    # the same preset, shapes reduced, through the command: its shards written as they fill
    small = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, vocab_size=768)
    out = build(tmp_path / "m", "llama3-70b-fp8", overrides=dict(small, num_hidden_layers=2),
                shard_bytes=200_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    spec = ModelSpec.from_dir(out)
    assert set(index["weight_map"]) == set(spec.expected_tensors())
    manifest = build_manifest(out, spec)
    assert {e.dtype for e in manifest.entries if e.name in spec.fp8_weights()} == {"float8_e4m3fn"}
    err = capsys.readouterr().err
    assert "shard 1 written: " in err and f"shard {len(files)} written: " in err and "(100%)" in err
    with pytest.raises(SystemExit):      # the preset is fp8-dynamic: another --quant is refused
        make_model.main(["--preset", "llama3-70b-fp8", "--quant", "fp8-block", "--out", str(tmp_path / "x")])
    assert "is fp8-dynamic; --quant fp8-block does not apply" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert PRESETS["llama3-70b-fp8"]["num_hidden_layers"] == 80


def test_make_model_quant_and_layers_flags(tmp_path):
    out = tmp_path / "t"
    assert make_model.main(["--preset", "tiny", "--quant", "fp8-block", "--layers", "1", "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["quantization_config"]["weight_block_size"] == [128, 128]
    assert ModelSpec.from_dir(out).quant.strategy == "block"


def test_tensor_parallel_groups_refuse_fp8_weights():
    from kvhold.protocol.tensor_parallel import tensor_parallel_refusal

    spec = ModelSpec.from_config(make_config("tiny", 512, 0, 1, "fp8-block"))
    assert "weights are FP8 (quant_method fp8, 128x128 block weight scales, dynamic" in tensor_parallel_refusal(spec, 2)
    assert tensor_parallel_refusal(spec, 1) is None
    assert tensor_parallel_refusal(dataclasses.replace(spec, quant=None), 2) is None


@pytest.mark.parametrize("quant", ("fp8-dynamic", "fp8-block"))
def test_a_recompute_gives_the_decode_steps_logits_on_cpu(ckpts, quant):
    """Recompute over FP8 weights, as the CPU engine's float64 recompute of a float checkpoint: one
    prefill of the prompt and the generated tokens, batched with another sequence, gives each
    row the logits prefill-then-decode gave to float64 rounding (the CPU BLAS blocks a product by
    its row count, so the last bits may differ; no token's margin is near that) and the same
    greedy token."""
    spec = ModelSpec.from_dir(ckpts[quant])
    model = LlamaModel(spec, load_file(str(ckpts[quant] / "model.safetensors")), torch.float64,
                       torch.device("cpu"), 64)
    stepped, tokens = _greedy_logits(spec, model, torch.float64)
    seq = PROMPT + tokens
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", PAGE), 64)
    other = [5, 6, 7, 8, 9, 10, 11]
    pages_a, pages_b = torch.arange(1, 32), torch.arange(32, 64)
    ids = seq + other
    pos = torch.cat([torch.arange(len(seq)), torch.arange(len(other))])
    write = torch.cat([pages_a[torch.arange(len(seq)) // PAGE], pages_b[torch.arange(len(other)) // PAGE]])
    step = StepInput(token_ids=torch.tensor(ids), positions=pos, write_pages=write, write_slots=pos % PAGE,
                     seqs=[SeqSlice(0, len(seq), len(seq), pages_a[:(len(seq) + PAGE - 1) // PAGE]),
                           SeqSlice(len(seq), len(other), len(other), pages_b[:2])],
                     logits_rows=torch.arange(len(seq) - 1))
    recomputed = model.forward(step, kv).double()
    want = stepped[:len(seq) - 1]
    assert ((recomputed - want).abs().max() / want.abs().max()) < 1e-12
    assert torch.equal(recomputed.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("quant", QUANTS)
def test_the_cuda_layers_hand_the_fp8_kernel_the_regions_bytes_and_scales_that_dequantize_as_the_weights(
        ckpts, quant):
    """The operands kvhold.executor.cuda.layers gives the in-register FP8 kernel are plain Python
    over the region (checked here, without a GPU): one FP8 view over a projection's adjacent parts
    (no copy of the weights), and float32 scales (one a row, or one a block) that dequantize that
    view to exactly the weight the dequantizing path multiplies by. Block scales whose rows do not
    tile a part (the tiny model's 64-row k and v, against 128-row blocks) leave it on that path."""
    pytest.importorskip("triton")
    from kvhold.executor.cuda.kernel_shapes import fp8_scales
    from kvhold.executor.cuda.layers import FusedLayers, _Fp8Projection
    from tools.bench_engine_setup import load_weights

    spec = ModelSpec.from_dir(ckpts[quant])
    assert fp8_scales(spec) == ("128x128" if quant == "fp8-block" else "rows")     # what the zygote compiles
    # one buffer laid out as the sidecar's region, the tensors views into it (as on the GPU)
    weights = load_weights(ckpts[quant], "cpu")
    fused = FusedLayers(LlamaModel(spec, weights, torch.bfloat16, torch.device("cpu"), 512))
    taken = 0
    for layer in fused.layers_w:
        for proj in (p for p in layer if isinstance(p, _Fp8Projection)):
            if proj.fp8 is None:
                assert quant == "fp8-block" and proj is layer[1]       # q|k|v
                continue
            w, scale, block = proj.fp8
            assert w.dtype == torch.float8_e4m3fn and w.data_ptr() == proj.parts[0].weight.data_ptr()
            assert scale.dtype == torch.float32 and scale.is_contiguous()
            if block is None:
                per_element = scale.reshape(-1, 1)
            else:
                assert quant == "fp8-block" and block == (128, 128)
                n, k = w.shape
                per_element = scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
            assert torch.equal((w.to(torch.float32) * per_element).to(torch.bfloat16), proj.dense())
            taken += 1
    assert taken == spec.num_layers * (3 if quant == "fp8-block" else 4)


def test_the_benchmarks_weight_loader_lays_out_and_names_the_tensors_in_the_regions_config_order(tmp_path):
    """tools.bench_engine_setup.load_weights reads one shard at a time (a 70B checkpoint and its
    region would not fit the GPU together) yet hands the tensors back in the region's order, each
    at its manifest offset: callers that copy them into another buffer in that order (the GPU
    tests' bf16 regions) keep q|k|v and gate|up adjacent, which the batch-invariant kernels need."""
    from safetensors.torch import load_file

    from kvhold.protocol.checkpoint import build_manifest
    from tools.bench_engine_setup import load_weights

    path = build(tmp_path / "m", "tiny", shard_bytes=150_000, progress=False, quant="fp8-dynamic")
    assert len(list(path.glob("*.safetensors"))) > 2
    manifest = build_manifest(path, ModelSpec.from_dir(path))
    weights = load_weights(path, "cpu")
    assert list(weights) == [e.name for e in manifest.entries]
    base = next(iter(weights.values())).untyped_storage().data_ptr()
    assert [w.data_ptr() - base for w in weights.values()] == [e.offset for e in manifest.entries]
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(f))
    assert all(torch.equal(w.view(torch.uint8), stored[name].view(torch.uint8)) for name, w in weights.items())
