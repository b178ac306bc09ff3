"""Weights are loaded once into the sidecar's region, then only mapped, read-only."""
import os
import signal

import torch
from safetensors.torch import load_file

from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput
from kvhold.protocol.layout import KvGeometry
from kvhold.protocol.model_spec import ModelSpec
from tests.process.helpers import sidecar_log

PROMPT_IDS = [0, 66, 351, 261, 267, 80, 300, 259, 422, 66, 85, 73]     # "after a loader death"


def greedy_from_checkpoint(model_dir, prompt_ids: list[int], n: int) -> list[int]:
    """The greedy continuation computed in this process from the checkpoint file itself (float64):
    what an executor computing from correctly loaded weights must return at temperature 0."""
    spec = ModelSpec.from_dir(model_dir)
    model = LlamaModel(spec, load_file(str(model_dir / "model.safetensors")), torch.float64,
                       torch.device("cpu"), 512)
    geometry = KvGeometry(num_layers=spec.num_layers, page_tokens=16, num_kv_heads=spec.num_kv_heads,
                          head_dim=spec.head_dim, dtype="float64")
    ids = list(prompt_ids)
    for _ in range(n):
        t = len(ids)
        kv = KvCache.private(geometry, (t + 15) // 16)
        pos = torch.arange(t)
        step = StepInput(token_ids=torch.tensor(ids), positions=pos, write_pages=pos // 16,
                         write_slots=pos % 16, seqs=[SeqSlice(0, t, t, torch.arange((t + 15) // 16))],
                         logits_rows=torch.tensor([t - 1]))
        ids.append(int(model.forward(step, kv)[0].argmax()))
    return ids[len(prompt_ids):]


def test_loaded_once_then_mapped_by_every_replacement(tiny_model, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), "--log-level", "INFO"])
    for _ in range(2):
        active = sc.wait_steady()
        os.kill(active["pid"], signal.SIGKILL)
        sc.wait_for(lambda st: all(e["pid"] != active["pid"] for e in st["executors"]), timeout=30)
    sc.wait_steady()
    log = sidecar_log(sc)
    assert log.count("loaded 39 tensors") == 1
    assert log.count("weights already sealed") >= 3
    assert sc.status()["weights"]["state"] == "sealed"


def test_a_loader_that_dies_is_replaced_before_sealing(tiny_model, start_sidecar, tmp_path):
    env = {"KVHOLD_FAULT": "weights_loaded:1:kill", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), "--log-level", "INFO"], env=env)
    sc.wait_steady()
    assert (tmp_path / "fired").exists()
    log = sidecar_log(sc)
    assert log.count("loads the weights") == 2       # the first loader died; another took over
    with sc.new_client() as client:
        # greedy, so the check is deterministic: default sampling (temperature 1, a random seed)
        # ends on the demo model's end-of-sequence token in a few requests per thousand
        result = client.generate(prompt_ids=PROMPT_IDS, max_tokens=4, temperature=0.0).result()
    assert result.token_ids == greedy_from_checkpoint(tiny_model, PROMPT_IDS, 4)
