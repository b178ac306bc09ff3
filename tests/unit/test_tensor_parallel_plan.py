"""Tensor parallelism's plan and arithmetic: which sizes a model splits into, the shards,
and a group of ranks (threads here, summing through a barrier) computing the same logits
as the whole model; and `--tensor-parallel-size` refused clearly where it cannot run."""
import argparse
import dataclasses
import threading

import pytest
import torch
from safetensors.torch import load_file

from kvhold.executor.kv_cache import KvCache
from kvhold.executor.llama import LlamaModel, SeqSlice, StepInput
from kvhold.executor.tensor_parallel.model import TensorParallelLlama
from kvhold.executor.tensor_parallel.plan import TpPlan
from kvhold.protocol.layout import KvGeometry
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.tensor_parallel import tensor_parallel_refusal
from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return ModelSpec.from_dir(tiny_model), load_file(str(tiny_model / "model.safetensors"))


def test_sizes_that_do_not_divide_are_refused(tiny):
    spec, _ = tiny
    assert tensor_parallel_refusal(spec, 1) is None and tensor_parallel_refusal(spec, 2) is None
    assert "at least 1" in tensor_parallel_refusal(spec, 0)
    assert "attention heads (4) do not divide by 3" in tensor_parallel_refusal(spec, 3)
    assert "KV heads (2) do not divide by 4" in tensor_parallel_refusal(spec, 4)
    assert "MLP intermediate size" in tensor_parallel_refusal(dataclasses.replace(spec, intermediate_size=385), 2)
    assert "NCCL" in tensor_parallel_refusal(spec, 2, "cuda:0")
    assert "fused" in tensor_parallel_refusal(dataclasses.replace(spec, model_type="phi3"), 2)
    with pytest.raises(ValueError, match="do not divide"):
        TpPlan(spec, 3)


def test_shards_are_column_and_row_slices_that_rebuild_the_model(tiny):
    spec, w = tiny
    plan = TpPlan(spec, 2)
    shards = [plan.shard(w, r) for r in range(2)]
    p = "model.layers.0."
    assert shards[0][p + "self_attn.q_proj.weight"].shape == (spec.num_heads // 2 * spec.head_dim, spec.hidden_size)
    assert shards[0][p + "self_attn.k_proj.weight"].shape[0] == spec.num_kv_heads // 2 * spec.head_dim
    assert shards[1][p + "mlp.down_proj.weight"].shape == (spec.hidden_size, spec.intermediate_size // 2)
    for name, t in w.items():
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        if shards[0][name].shape == t.shape:
            assert all(torch.equal(s[name], t) for s in shards), name       # replicated
        else:
            assert torch.equal(torch.cat([s[name] for s in shards], dim=dim), t), name
    assert plan.kv_geometry("float32", 16).num_kv_heads == spec.num_kv_heads // 2


def _step(prompt):
    t = len(prompt)
    return StepInput(token_ids=torch.tensor(prompt), positions=torch.arange(t), write_pages=torch.arange(t) // 16,
                     write_slots=torch.arange(t) % 16, seqs=[SeqSlice(0, t, t, torch.arange(2))],
                     logits_rows=torch.tensor([t - 1]))


def test_two_ranks_compute_the_whole_models_logits(tiny):
    spec, w = tiny
    prompt = [1, 17, 99, 240, 5, 33, 8, 400, 12]
    whole = LlamaModel(spec, w, torch.float64, torch.device("cpu"), 64)
    kv = KvCache.private(KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", 16), 2)
    expected = whole.forward(_step(prompt), kv)

    plan = TpPlan(spec, 2)
    barrier, parts, out = threading.Barrier(2), [None, None], [None, None]

    def reduce_for(rank):
        def reduce(t):
            parts[rank] = t.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            t.copy_(total)
            return t
        return reduce

    def rank_main(rank):
        m = TensorParallelLlama(plan, plan.shard(w, rank), torch.float64, 64, reduce=reduce_for(rank))
        rkv = KvCache.private(plan.kv_geometry("float64", 16), 2)
        out[rank] = m.forward(_step(prompt), rkv)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(out[0], out[1])
    torch.testing.assert_close(out[0], expected, rtol=1e-10, atol=1e-10)


def test_ranks_write_their_heads_of_one_pool_and_the_checksum_covers_every_rank(tiny):
    """Served groups (kvhold.executor.tensor_parallel.ranks): each rank writes its KV heads of the
    N = 1 pool layout, so the pool two ranks write equals the whole model's, and a page's checksum
    changes with any rank's bytes (a takeover's validation covers every rank)."""
    from kvhold.executor.tensor_parallel.ranks import rank_kv
    from kvhold.protocol.checksum import TorchChecksum

    spec, w = tiny
    prompt = [1, 17, 99, 240, 5, 33, 8, 400, 12]
    geometry = KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64", 16)
    whole_kv = KvCache.private(geometry, 2)
    LlamaModel(spec, w, torch.float64, torch.device("cpu"), 64).forward(_step(prompt), whole_kv)

    plan = TpPlan(spec, 2)
    shared = KvCache.private(geometry, 2)
    views = [rank_kv(shared, plan, r) for r in range(2)]
    assert views[0].pool.shape[-2] == views[1].pool.shape[-2] == spec.num_kv_heads // 2
    barrier, parts = threading.Barrier(2), [None, None]

    def reduce_for(rank):
        def reduce(t):
            parts[rank] = t.clone()
            barrier.wait()
            total = parts[0] + parts[1]
            barrier.wait()
            t.copy_(total)
            return t
        return reduce

    def rank_main(rank):
        m = TensorParallelLlama(plan, plan.shard(w, rank), torch.float64, 64, reduce=reduce_for(rank))
        m.forward(_step(prompt), views[rank])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    torch.testing.assert_close(shared.pool, whole_kv.pool, rtol=1e-10, atol=1e-10)
    hasher = TorchChecksum(shared.pool)
    page = torch.tensor([0])
    before = hasher.pages(page, torch.tensor([len(prompt)])).tolist()
    for r in range(2):
        kept = views[r].pool[0, 0, 0, 0].clone()
        views[r].pool[0, 0, 0, 0] += 1.0         # rank r's heads of one token row only
        assert hasher.pages(page, torch.tensor([len(prompt)])).tolist() != before, f"rank {r}"
        views[r].pool[0, 0, 0, 0] = kept
        assert hasher.pages(page, torch.tensor([len(prompt)])).tolist() == before


def _args(*argv):
    p = argparse.ArgumentParser()
    add_sidecar_args(p)
    return p.parse_args(list(argv))


def test_the_flag_is_checked_against_the_model_and_reaches_the_executors(tiny_model):
    cfg = sidecar_config_from_args(_args("--model", str(tiny_model)))
    assert cfg.pool.tensor_parallel_size == 1 and cfg.executor_settings().tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: the model's attention heads"):
        sidecar_config_from_args(_args("--model", str(tiny_model), "--tensor-parallel-size", "3"))
    cfg = sidecar_config_from_args(_args("--model", str(tiny_model), "-tp", "2"))
    assert cfg.pool.tensor_parallel_size == 2 and cfg.executor_settings().tensor_parallel_size == 2
    for extra, what in ((["--zygote"], "--zygote is not supported"),
                        (["--kv-mode", "foreign"], "--kv-mode foreign is not supported")):
        with pytest.raises(ValueError, match=what):
            sidecar_config_from_args(_args("--model", str(tiny_model), "-tp", "2", *extra))
    with pytest.raises(ValueError, match="NCCL"):
        sidecar_config_from_args(_args("--model", str(tiny_model), "--tensor-parallel-size", "2",
                                       "--device", "cuda", "--backend", "cuda"))
    with pytest.raises(ValueError, match="at least 1"):
        sidecar_config_from_args(_args("--tensor-parallel-size", "0"))
