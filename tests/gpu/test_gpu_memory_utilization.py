"""GPU: `--gpu-memory-utilization` sizes the KV pool from the device's memory as NVML reports it
(the sidecar holds no CUDA context), less the weights and a reserve per executor. Skipped elsewhere."""
import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_kv_pool_is_the_share_left_after_weights_and_reserves(tiny_model):
    from kvhold.protocol.model_spec import ModelSpec
    from kvhold.sidecar.config import EXECUTOR_RESERVE_BYTES, PoolConfig, SidecarConfig, gpu_total_bytes

    total = gpu_total_bytes("cuda:0")
    assert abs(total - torch.cuda.get_device_properties(0).total_memory) < (1 << 30)
    cfg = SidecarConfig(pool=PoolConfig(model=tiny_model, backend="cuda", device="cuda:0",
                                        gpu_memory_utilization=0.5))
    spec = ModelSpec.from_dir(tiny_model)
    kv = cfg.kv_bytes_for_utilization(spec)
    assert 0 < kv <= total // 2 - 2 * EXECUTOR_RESERVE_BYTES
    geometry = cfg.table_geometry(spec)
    assert geometry.num_pages == kv // geometry.kv.page_bytes
