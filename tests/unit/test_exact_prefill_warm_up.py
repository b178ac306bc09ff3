"""A standby's exact-prefill warm-up launches every compiled kernel a chunk can: a kernel first
launched in a serving step compiles there for about a second, longer than the lease, and the
executor is fenced as a hang (kvhold.executor.cuda.runner.exact_warm_up_rows)."""
import pytest

pytest.importorskip("triton")

from kvhold.executor.cuda import gemm as cuda_gemm  # noqa: E402
from kvhold.executor.cuda.attention import prefill_launch_key  # noqa: E402
from kvhold.executor.cuda.runner import exact_warm_up_rows  # noqa: E402

LLAMA_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
TINY = ((96, 64), (64, 64), (256, 64), (64, 128))


def _key(shapes, m):
    return tuple(cuda_gemm.exact_launch_key(n, k, m) for n, k in shapes), prefill_launch_key(m)


@pytest.mark.parametrize("wide", ["0", "1", ""])
@pytest.mark.parametrize("shapes", [LLAMA_8B, TINY])
@pytest.mark.parametrize("chunk", [2048, 512, 248, 64, 17, 2])
def test_every_chunk_size_launches_only_kernels_the_warm_up_launched(shapes, chunk, wide, monkeypatch):
    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", wide)
    rows = exact_warm_up_rows(chunk, shapes)
    warmed = {_key(shapes, m) for m in rows}
    assert all(2 <= m <= chunk for m in rows)
    assert len(warmed) == len(rows)                     # one chunk per combination of kernels
    missing = [m for m in range(2, chunk + 1) if _key(shapes, m) not in warmed]
    assert not missing, missing[:10]


def test_the_kinds_of_chunk_a_hand_picked_list_missed_are_warmed():
    rows = exact_warm_up_rows(2048, LLAMA_8B)
    assert rows[:4] == [2048, 2047, 2046, 2044]         # a full chunk, and the three kinds of shorter one
    warmed = {_key(LLAMA_8B, m) for m in rows}
    # 48 rows: the decode tiles of 64 rows at a multiple of 16; 1000 rows: not a multiple of 16,
    # its staged rows 16-byte aligned; 2, 6 and 1002 rows: the block table and the int64 rows
    # aligned, the zeros not (these compiled in a step on Llama-3-8B's shapes)
    for m in (48, 32, 16, 1000, 20, 2, 6, 1002):
        assert _key(LLAMA_8B, m) in warmed, m
    for m in (48, 32, 16):
        assert _key(LLAMA_8B, m) not in {_key(LLAMA_8B, n) for n in (2048, 2047, 40, 17, 5)}


def test_the_fused_layers_decide_batch_invariance_and_exact_prefill_without_a_gpu(tiny_model):
    """The CUDA layers' decisions are plain Python over shapes: they run here, on a bf16 model
    whose q|k|v and gate|up lie back to back as the sidecar's weights region stores them, so a
    mistake in them shows without a GPU (a standby on CUDA runs them before its first step)."""
    import torch
    from safetensors.torch import load_file

    from kvhold.executor.cuda.layers import FusedLayers
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.model_spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_model)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(str(tiny_model / "model.safetensors")).items()}
    for layer in range(spec.num_layers):
        for parts in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            keys = [f"model.layers.{layer}.{p}.weight" for p in parts]
            joined, start = torch.cat([weights[k] for k in keys]), 0
            for k in keys:
                rows = weights[k].shape[0]
                weights[k], start = joined[start:start + rows], start + rows
    fused = FusedLayers(LlamaModel(spec, weights, torch.bfloat16, torch.device("cpu"), 512))
    assert fused.fused_gemms
    hidden, q = spec.hidden_size, spec.num_heads * spec.head_dim
    assert fused.projection_shapes() == ((q + 2 * spec.num_kv_heads * spec.head_dim, hidden), (hidden, q),
                                         (2 * spec.intermediate_size, hidden), (hidden, spec.intermediate_size))
    for rows in (cuda_gemm.MAX_ROWS, cuda_gemm.MAX_ROWS + 1, cuda_gemm.MAX_DECODE_ROWS):
        assert fused.batch_invariant(rows) and fused.exact_prefill(rows) is None
    assert not fused.batch_invariant(cuda_gemm.MAX_DECODE_ROWS + 1)
    assert "max_batch <= 256" in fused.exact_prefill(cuda_gemm.MAX_DECODE_ROWS + 1)
    assert cuda_gemm.decode_buckets(8) == [8] and cuda_gemm.decode_buckets(64) == [16, 32, 64]
    assert cuda_gemm.decode_buckets(100) == [16, 32, 64, 100]
    assert cuda_gemm.decode_buckets(256) == [16, 32, 64, 128, 256]
    assert cuda_gemm.decode_buckets(257) == [257]                   # past the kernel's rows: cuBLAS, one bucket
    rows = exact_warm_up_rows(512, fused.projection_shapes())
    assert rows[0] == 512 and rows == sorted(set(rows), reverse=True)


@pytest.mark.parametrize("vocab,hidden", [(128256, 4096), (512, 128)])
def test_prompt_logprob_rows_of_any_count_launch_only_logits_kernels_the_warm_up_launched(vocab, hidden):
    """A prefill chunk's prompt log-prob rows reach the logits GEMM at any count up to 64 (a
    decode step only at its buckets): the warm-up runs one count per compiled kernel."""
    rows = cuda_gemm.logits_warm_up_rows(vocab, hidden)
    warmed = {cuda_gemm.exact_launch_key(vocab, hidden, m) for m in rows}
    assert len(warmed) == len(rows) and all(2 <= m <= cuda_gemm.MAX_ROWS for m in rows)
    for m in range(2, cuda_gemm.MAX_ROWS + 1):
        assert cuda_gemm.exact_launch_key(vocab, hidden, m) in warmed, m
    # the decode buckets' counts (multiples of 16) leave the others to compile
    buckets = {cuda_gemm.exact_launch_key(vocab, hidden, m) for m in (16, 32, 64)}
    assert any(cuda_gemm.exact_launch_key(vocab, hidden, m) not in buckets for m in (17, 20, 40))


def test_the_logits_warm_up_runs_the_models_logits_at_each_count(tiny_model):
    import torch
    from safetensors.torch import load_file

    from kvhold.executor.cuda.runner import warm_up_logits
    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.model_spec import ModelSpec

    spec = ModelSpec.from_dir(tiny_model)
    model = LlamaModel(spec, load_file(str(tiny_model / "model.safetensors")), torch.float32,
                       torch.device("cpu"), 64)
    seen = []
    real = model.logits
    model.logits = lambda h: seen.append(tuple(h.shape)) or real(h)
    rows = warm_up_logits(model, torch.device("cpu"))
    assert rows and seen == [(m, spec.hidden_size) for m in rows]


def test_wide_decode_tiles_put_65_to_128_rows_on_the_64_row_tile_by_default_and_256_when_asked(monkeypatch):
    """Rows 65..128 launch the 64-row decode tile over row blocks by default (one compiled kernel
    per (N, K) and row-count divisibility), 129..256 the prefill tiles; KVHOLD_WIDE_DECODE_TILES=1
    takes 65..256 on the wide tile, =0 none; 1..64 and 257+ launch the same kernels throughout."""
    n, k = LLAMA_8B[1]
    keys = {}
    for value in ("0", "1", None):
        if value is None:
            monkeypatch.delenv("KVHOLD_WIDE_DECODE_TILES", raising=False)
        else:
            monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", value)
        keys[value] = {m: cuda_gemm.exact_launch_key(n, k, m) for m in range(1, 600)}
    plain, wide, default = keys["0"], keys["1"], keys[None]
    same = [*range(1, 65), *range(257, 600)]
    assert all(wide[m] == plain[m] == default[m] for m in same)
    assert all(plain[m][0] == "prefill" for m in range(65, 257))
    wide_keys = {("wide", cuda_gemm.tiles(n, k, 64), True), ("wide", cuda_gemm.tiles(n, k, 64), False)}
    assert {wide[m] for m in range(65, 257)} == wide_keys == {default[m] for m in range(65, 129)}
    assert all(default[m] == plain[m] for m in range(129, 257))
    assert cuda_gemm.wide(128) and not cuda_gemm.wide(129) and not cuda_gemm.wide(64)
    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", "1")
    assert cuda_gemm.wide(256) and not cuda_gemm.wide(64) and not cuda_gemm.wide(257)


def test_an_unknown_wide_tiles_setting_is_refused_not_read_as_the_default(monkeypatch):
    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", "off")
    with pytest.raises(ValueError, match="KVHOLD_WIDE_DECODE_TILES='off'"):
        cuda_gemm.wide(100)


@pytest.mark.parametrize("wide", ["0", "1", ""])
def test_each_launch_key_gives_one_fp8_tile_and_the_fp8_decode_tile_widens_where_the_waves_allow(wide, monkeypatch):
    """The FP8 kernel's tiles follow from gemm.exact_launch_key (the warm-ups launch one row count
    per key), and on the decode tiles take 64 columns a program unless that fills the SMs' waves
    worse than the bf16 choice: Llama-3-70B's q|k|v (160 programs) keeps 32, its o and down take 64."""
    from kvhold.executor.cuda import fp8_gemm

    monkeypatch.setenv("KVHOLD_WIDE_DECODE_TILES", wide)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (10240, 8192), (8192, 8192),
              (57344, 8192), (8192, 28672), (1000, 1024)]
    for n, k in shapes:
        by_key = {}
        for rows in range(1, 300):
            for block_k_max in (k, 128):
                tile = fp8_gemm._tiles(n, k, rows, block_k_max)
                assert by_key.setdefault((cuda_gemm.exact_launch_key(n, k, rows), block_k_max), tile) == tile
    assert fp8_gemm._tiles(10240, 8192, 16, 8192)[1] == 32 and fp8_gemm._tiles(10240, 8192, 64, 8192)[1] == 32
    assert all(fp8_gemm._tiles(n, k, rows, k)[1] == 64 for n, k in ((8192, 8192), (8192, 28672)) for rows in (1, 16, 64))
    assert fp8_gemm._tiles(8192, 8192, 64, 8192)[4] <= 4        # five stages of 64 x 256 do not fit shared memory
