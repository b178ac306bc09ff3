"""The zygote hands a request to its spare only if the spare made its CUDA context in the
environment the request asks for."""
from kvhold.executor.zygote import Spare


def test_a_spare_takes_requests_that_keep_its_cuda_environment():
    spare = Spare(pid=0, request_fd=-1, ready_fd=-1, env={"CUDA_VISIBLE_DEVICES": "0", "HOME": "/root"})
    assert spare.takes({"OMP_WAIT_POLICY": "PASSIVE"})
    assert spare.takes({"CUDA_VISIBLE_DEVICES": "0", "HOME": "/elsewhere"})
    assert not spare.takes({"CUDA_VISIBLE_DEVICES": "1"})
    assert not spare.takes({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert Spare(0, -1, -1, {}).takes({})
