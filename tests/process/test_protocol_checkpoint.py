"""Checkpoint manifests: sizes from headers alone, and errors that name the file and tensor."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvhold.protocol.checkpoint import build_manifest
from kvhold.protocol.model_spec import CheckpointError, ModelSpec


@pytest.fixture
def ckpt(tiny_model, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_model, path)
    return path


def test_manifest_covers_every_tensor_in_config_order(ckpt):
    spec = ModelSpec.from_dir(ckpt)
    m = build_manifest(ckpt, spec)
    assert [e.name for e in m.entries] == list(spec.expected_tensors())
    assert all(e.offset % 256 == 0 for e in m.entries)
    assert m.region_bytes >= sum(e.nbytes for e in m.entries)
    assert m.fingerprint == build_manifest(ckpt, spec).fingerprint


def _rewrite(ckpt, mutate):
    tensors = load_file(str(ckpt / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))


@pytest.mark.parametrize("mutate,needle", [
    (lambda t: t.__setitem__("model.layers.1.mlp.up_proj.weight", torch.zeros(3, 3)),
     "model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight': shape [3, 3]"),
    (lambda t: t.pop("model.layers.3.self_attn.k_proj.weight"),
     "missing, first 'model.layers.3.self_attn.k_proj.weight'"),
    (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)),
     "tensor 'model.layers.0.extra.weight' is not part of a llama model"),
    (lambda t: t.__setitem__("model.norm.weight", torch.zeros(128, dtype=torch.int32)),
     "tensor 'model.norm.weight': dtype I32"),
])
def test_mismatches_name_the_file_and_tensor(ckpt, mutate, needle):
    _rewrite(ckpt, mutate)
    with pytest.raises(CheckpointError, match=None) as info:
        build_manifest(ckpt, ModelSpec.from_dir(ckpt))
    assert needle in str(info.value)


def test_missing_and_broken_files(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        ModelSpec.from_dir(ckpt)
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        ModelSpec.from_dir(ckpt)
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        ModelSpec.from_dir(ckpt)


def test_truncated_weights_file(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated file"):
        build_manifest(ckpt, ModelSpec.from_dir(ckpt))


def test_the_sidecar_refuses_a_bad_checkpoint_with_the_reason(ckpt, runtime_root):
    _rewrite(ckpt, lambda t: t.pop("lm_head.weight"))
    out = subprocess.run([sys.executable, "-m", "kvhold", "sidecar", "--model", str(ckpt),
                          "--runtime-root", str(runtime_root), "--instance", "badckpt"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "'lm_head.weight'" in out.stderr
