"""FP8 checkpoints: the quantization scheme of a config.json's `quantization_config`.

Read as transformers and vLLM read it, and refused, with the scheme named, wherever it is
anything the engine does not compute; an FP8 checkpoint is never loaded as if its weights
were plain floats. Two families are read:

* `quant_method: "compressed-tensors"` (llm-compressor's output), `format` "float-quantized"
  (or "naive-quantized"), one scheme for every targeted Linear: weights `{"num_bits": 8,
  "type": "float", "symmetric": true}` with `strategy` "channel" (a `weight_scale` of shape
  [out, 1]: FP8-Dynamic's) or "tensor" (one `weight_scale`, shape [1] or []); input
  activations dynamic ("token" or "tensor" strategy: quantized at run time), static
  per-tensor (an `input_scale` per layer, shape [1] or []) or absent (weight-only). Modules
  named in `ignore` (an exact name, a name's last parts after a dot, or "re:<regex>" matched
  at the start of the name, as compressed-tensors matches) stay in the checkpoint's float dtype.
* `quant_method: "fp8"` (transformers' fine-grained FP8, DeepSeek-V3 and Qwen FP8
  checkpoints): with `weight_block_size` [bn, bk], a `weight_scale_inv` of shape
  [ceil(out/bn), ceil(in/bk)] per weight, activations dynamic only; without it the older
  per-tensor form (a `weight_scale` per weight, an `input_scale` where `activation_scheme` is
  "static"). `modules_to_not_convert` entries stay float, matched as substrings of the module
  name (transformers' rule).

Either way a quantized weight is `float8_e4m3fn`, and its dequantized value is
`weight.float() * scale` with the scale broadcast per output row (channel), over the whole
tensor (tensor) or per bn x bk block (block; `weight_scale_inv` multiplies, despite its name,
as transformers and vLLM apply it). The decoder's Linear layers (q/k/v/o, gate/up/down, Phi-3's
fused qkv_proj and gate_up_proj) are the ones quantized; embeddings, norms and `lm_head` never
are (neither transformers nor vLLM quantizes the output head of these formats; a checkpoint
that stores one in FP8 is refused by the manifest's dtype check). No torch here: the sidecar
sizes the weights region from this.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

SUPPORTED = ("compressed-tensors float-quantized with channel or tensor FP8 weights; "
             "fp8 (weight_block_size, or per-tensor)")
FP8_MAX = 448.0        # the largest finite float8_e4m3fn


@dataclass(frozen=True, slots=True)
class Fp8Scheme:
    method: str                  # "compressed-tensors" | "fp8"
    strategy: str                # "channel" | "tensor" | "block"
    activation: str              # "dynamic" | "static" | "none" (weight-only)
    block: tuple[int, int] | None = None
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)

    @property
    def scale_name(self) -> str:
        """The suffix of a weight's scale tensor, beside `weight`."""
        return "weight_scale_inv" if self.strategy == "block" else "weight_scale"

    @property
    def describe(self) -> str:
        scales = (f"{self.block[0]}x{self.block[1]} block" if self.strategy == "block"
                  else f"per-{self.strategy}")
        return f"quant_method {self.method}, {scales} weight scales, {self.activation} activations"

    def quantized(self, module: str) -> bool:
        """Whether the Linear `module` (e.g. "model.layers.0.self_attn.q_proj") is stored in FP8."""
        if module == "lm_head" or module.endswith(".lm_head"):
            return False
        if any(_ignored(self.method, module, entry) for entry in self.ignore):
            return False
        return any(t == "Linear" or _matches(module, t) for t in self.targets)

    def scale_shapes(self, shape: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """The scale tensors of a quantized weight of `shape` [out, in]: suffix -> shape. A
        per-tensor scale's shape is (), and a stored [1] is accepted for it too."""
        out, inp = shape
        if self.strategy == "block":
            bn, bk = self.block
            scales = {"weight_scale_inv": (-(-out // bn), -(-inp // bk))}
        elif self.strategy == "channel":
            scales = {"weight_scale": (out, 1)}
        else:
            scales = {"weight_scale": ()}
        if self.activation == "static":
            scales["input_scale"] = ()
        return scales


def _matches(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return module == entry or module.endswith("." + entry)


def _ignored(method: str, module: str, entry: str) -> bool:
    if method == "fp8":            # transformers: an entry anywhere in the module's name
        return entry in module
    return _matches(module, entry)


def parse_quantization(cfg: dict) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json, None for an unquantized checkpoint; ValueError naming
    the scheme for anything else."""
    q = cfg.get("quantization_config")
    if q is None:
        if cfg.get("compression_config") is not None:
            raise ValueError("compression_config (an older spelling of compressed-tensors' "
                             "quantization_config) is not supported")
        return None
    if not isinstance(q, dict):
        raise ValueError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "fp8":
        return _hf_fp8(q)
    raise ValueError(f"quantization_config quant_method {method!r} is not supported "
                     f"(supported: {SUPPORTED})")


def _compressed_tensors(q: dict) -> Fp8Scheme:
    what = "compressed-tensors"
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(f"{what} format {fmt!r} is not supported (float-quantized FP8 only)")
    status = q.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{what} quantization_status {status!r} is not supported (compressed only)")
    sparsity = q.get("sparsity_config")
    if sparsity is not None and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        fmt = sparsity.get("format") if isinstance(sparsity, dict) else sparsity
        raise ValueError(f"{what} sparsity_config format {fmt!r} is not supported (dense weights only)")
    if q.get("transform_config") is not None:
        raise ValueError(f"{what} transform_config is not supported (no weight transforms)")
    if q.get("kv_cache_scheme") is not None:
        raise ValueError(f"{what} kv_cache_scheme {q['kv_cache_scheme']!r} is not supported "
                         "(the KV cache is kept in the compute dtype)")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{what} without config_groups is not supported")
    schemes, targets = set(), []
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise ValueError(f"{what} config_groups.{name} must be an object")
        if g.get("format") not in (None, "float-quantized", "naive-quantized"):
            raise ValueError(f"{what} config_groups.{name} format {g['format']!r} is not supported")
        if g.get("output_activations") is not None:
            raise ValueError(f"{what} config_groups.{name}: output_activations quantization is not supported")
        schemes.add(_ct_group(name, g))
        targets += [str(t) for t in g.get("targets") or ()]
    if len(schemes) > 1:
        raise ValueError(f"{what} with {len(schemes)} different schemes across config_groups is not "
                         "supported (one FP8 scheme for every quantized layer)")
    strategy, activation = schemes.pop()
    if not targets:
        raise ValueError(f"{what} config_groups name no targets")
    ignore = tuple(str(x) for x in q.get("ignore") or ())
    return Fp8Scheme(method="compressed-tensors", strategy=strategy, activation=activation,
                     ignore=ignore, targets=tuple(dict.fromkeys(targets)))


def _ct_group(name: str, g: dict) -> tuple[str, str]:
    w = g.get("weights")
    where = f"compressed-tensors config_groups.{name}"
    if not isinstance(w, dict):
        raise ValueError(f"{where}: weights scheme missing")
    kind = f"weights num_bits={w.get('num_bits')} type={w.get('type')} strategy={w.get('strategy')}"
    if w.get("num_bits") != 8 or w.get("type") != "float":
        raise ValueError(f"{where}: {kind} is not supported (8-bit float weights only)")
    if w.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"{where}: {kind} is not supported (FP8 strategies: channel, tensor)")
    if not w.get("symmetric", True) or w.get("dynamic", False) or w.get("group_size") is not None \
            or w.get("block_structure") is not None or w.get("actorder") is not None:
        raise ValueError(f"{where}: {kind} with symmetric={w.get('symmetric')} dynamic={w.get('dynamic')} "
                         f"group_size={w.get('group_size')} block_structure={w.get('block_structure')} "
                         f"actorder={w.get('actorder')} is not supported (symmetric static FP8 weights)")
    a = g.get("input_activations")
    if a is None:
        return w["strategy"], "none"
    akind = (f"input_activations num_bits={a.get('num_bits')} type={a.get('type')} "
             f"strategy={a.get('strategy')} dynamic={a.get('dynamic')}")
    if a.get("num_bits") != 8 or a.get("type") != "float" or not a.get("symmetric", True) \
            or a.get("group_size") is not None:
        raise ValueError(f"{where}: {akind} is not supported (8-bit float symmetric activations)")
    if a.get("dynamic") is True and a.get("strategy") in ("token", "tensor"):
        return w["strategy"], "dynamic"
    if a.get("dynamic") is False and a.get("strategy") == "tensor":
        return w["strategy"], "static"
    raise ValueError(f"{where}: {akind} is not supported (dynamic per-token or per-tensor, or static "
                     "per-tensor activations)")


def _hf_fp8(q: dict) -> Fp8Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"fp8 fmt {fmt!r} is not supported (e4m3)")
    act = q.get("activation_scheme", "dynamic")
    block = q.get("weight_block_size")
    ignore = tuple(str(x) for x in q.get("modules_to_not_convert") or ())
    if block is None:
        if act not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme {act!r} is not supported (dynamic, static)")
        return Fp8Scheme(method="fp8", strategy="tensor", activation=act, ignore=ignore)
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"fp8 weight_block_size {block!r} is not supported (two positive integers)")
    if act != "dynamic":
        raise ValueError(f"fp8 weight_block_size {block} with activation_scheme {act!r} is not supported "
                         "(block-quantized weights take dynamic activations)")
    return Fp8Scheme(method="fp8", strategy="block", activation="dynamic", block=(block[0], block[1]),
                     ignore=ignore)
