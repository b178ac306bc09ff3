"""materialize: a Hugging Face Llama built on meta runs on the sidecar's weights region.

A real sidecar (host backend) loads and seals the tiny checkpoint through its executor;
the test maps the sealed region read-only and compares against `from_pretrained`.
Logits must be bitwise equal: same transformers code, same float32 bytes, same CPU
kernels and shapes, so any difference would mean the views hold different weights.
"""
import faulthandler
import json
import os
import resource
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")
from transformers import AutoConfig, LlamaForCausalLM  # noqa: E402

from kvhold.executor.weights import WeightsRegion  # noqa: E402
from kvhold.protocol.checkpoint import build_manifest  # noqa: E402
from kvhold.protocol.memory import HostRegion  # noqa: E402
from kvhold.protocol.model_spec import ModelSpec  # noqa: E402
from kvhold.testing.sidecar_process import SidecarProcess  # noqa: E402
from kvhold.executor.materialize import (MaterializeError, materialize, open_host_weights,  # noqa: E402
                                       region_bounds)

FLAGS = ["--standbys", "0", "--kv-pages", "16", "--max-seq-len", "64", "--max-batch", "4",
         "--max-batch-tokens", "32", "--log-level", "WARNING"]
PROMPTS = [[1, 5, 9, 33, 200, 7, 8, 9, 301, 44, 2, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
           [1, 400, 13, 13, 13, 77, 0, 511, 250, 3, 99, 100]]


@pytest.fixture(scope="module")
def region(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "sidecar.log"
    with SidecarProcess(["--model", str(tiny_model), *FLAGS], log_path=log) as sc:
        sc.wait_for(lambda st: st["weights"]["state"] == "sealed", timeout=60)
        yield open_host_weights(sc.instance, tiny_model)


def meta_model(model_dir, **overrides):
    config = AutoConfig.from_pretrained(model_dir, **overrides)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def on_region(model_dir, weights, dtype=None, **overrides):
    """The bridge's recipe for transformers: meta build, views, rotary buffers recomputed."""
    model = meta_model(model_dir, **overrides).to(dtype or torch.float32)
    return materialize(model, weights, init_buffers=lambda name, module: model._init_weights(module)).eval()


@torch.no_grad()
def logits(model):
    return model(torch.tensor(PROMPTS)).logits


def test_logits_equal_from_pretrained(tiny_model, region):
    model = on_region(tiny_model, region)
    reference = LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert torch.equal(logits(model), logits(reference))


def test_parameters_view_the_read_only_region(tiny_model, region):
    model = on_region(tiny_model, region)
    lo, hi = region_bounds(region)
    entries = region.manifest.by_name()
    for name, p in model.named_parameters():
        assert p.data_ptr() == lo + entries[name].offset, name      # the view, not a copy
        assert not p.requires_grad
    assert lo <= model.lm_head.weight.data_ptr() < hi
    assert _mapping_perms(lo) == "r--s"                              # PROT_READ, shared
    status = _write_in_child(model.model.layers[0].mlp.up_proj.weight)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV


def _mapping_perms(address: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line.split()[1]
    raise AssertionError("address not mapped")


def _write_in_child(tensor) -> int:
    pid = os.fork()
    if pid == 0:                                                     # pragma: no cover - child
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        faulthandler.disable()                                       # the crash is the point
        with torch.no_grad():
            tensor.view(-1)[0] = 1.0
        os._exit(0)
    return os.waitpid(pid, 0)[1]


def test_tied_embeddings_stay_tied(tiny_model, tmp_path):
    tied = tmp_path / "tied"
    tied.mkdir()
    cfg = json.loads((tiny_model / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps(dict(cfg, tie_word_embeddings=True)))
    tensors = load_file(tiny_model / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tied / "model.safetensors")
    weights, shm = _local_region(tied)
    try:
        model = on_region(tied, weights)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        reference = LlamaForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
        assert torch.equal(logits(model), logits(reference))
    finally:
        shm.unlink()


def _local_region(model_dir):
    """Load a checkpoint into a private host region exactly as the sidecar's loader does."""
    manifest = build_manifest(model_dir, ModelSpec.from_dir(model_dir))
    shm = HostRegion(f"/kvhold-test-mat-{os.getpid()}", "weights", manifest.region_bytes)
    weights = WeightsRegion(shm.map_local(), manifest, model_dir)
    weights.load()                                                   # seals it PROT_READ
    return weights, shm


def test_mismatches_are_named(tiny_model, region):
    with pytest.raises(MaterializeError, match=r"model\.embed_tokens\.weight: module has .* torch\.bfloat16"):
        on_region(tiny_model, region, dtype=torch.bfloat16)
    with pytest.raises(MaterializeError, match=r"checkpoint tensor model\.layers\.3\.\S+ matches no"):
        on_region(tiny_model, region, num_hidden_layers=3)
    with pytest.raises(MaterializeError, match=r"model\.rotary_emb are not in the checkpoint"):
        materialize(meta_model(tiny_model), region)                  # no init_buffers
    model = meta_model(tiny_model)
    model.extra = torch.nn.Linear(2, 2)
    model.extra.to_empty(device="meta")
    with pytest.raises(MaterializeError, match=r"parameter extra\.weight is still on meta"):
        materialize(model, region, init_buffers=lambda n, m: None)
    materialize(model, region, strict=False)                          # non-strict: left to the caller
    assert model.extra.weight.is_meta and not model.lm_head.weight.is_meta


def test_rename_maps_module_names_to_checkpoint_names(tiny_model, region):
    from transformers import LlamaModel

    with torch.device("meta"):
        base = LlamaModel(AutoConfig.from_pretrained(tiny_model))   # names lack the "model." prefix
    materialize(base, region, rename=lambda name: "model." + name, strict=False,
                init_buffers=lambda name, module: base._init_weights(module))
    assert not any(p.is_meta for p in base.parameters())
    offset = region.manifest.by_name()["model.norm.weight"].offset
    assert base.norm.weight.data_ptr() == region_bounds(region)[0] + offset
