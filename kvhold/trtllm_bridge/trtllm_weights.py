"""TensorRT-LLM weights from the sidecar's region: no checkpoint read, and views where possible.

Written against TensorRT-LLM 1.2 (repository NVIDIA/TensorRT-LLM; the checkpoints/ files read
at commit b35ac1b6, whose version.py says 1.2.0rc2; model_loader.py at commits 004b733e and
b51992a3; tensorrt_llm/llmapi/llm_args.py's `validate_checkpoint_format`):
* tensorrt_llm/_torch/pyexecutor/model_loader.py: `ModelLoader.load(checkpoint_dir,
  checkpoint_loader)` builds the model under `MetaInitMode()`, materializes meta tensors with
  `torch.empty_like(t, device='cuda')`, then for `LoadFormat.AUTO` calls
  `checkpoint_loader.load_weights(checkpoint_dir, mapping=...)`,
  `checkpoint_loader.get_initialized_weight_mapper(model, config)` and
  `model.load_weights(weights, weight_mapper)` (looked up at call time), then every
  module's `post_load_weights()`. `ModelLoader._call_load_weights` passes `weight_mapper=`
  (and, at 004b733e, `allow_partial_loading=`) only when
  `inspect.getfullargspec(load_method).args` names it; otherwise it calls
  `load_method(weights)`, the legacy path without a mapper. `getfullargspec` does not follow
  `__wrapped__`, so a `*args, **kwargs` wrapper would send TensorRT-LLM down that path:
  `load_then_rebind` has the wrapped method's explicit signature (`explicit_signature`).
* tensorrt_llm/_torch/models/checkpoints/base_checkpoint_loader.py: `BaseCheckpointLoader`
  (`load_weights(checkpoint_dir, **kwargs) -> dict[str, Any]`,
  `get_initialized_weight_mapper(model, config)`); hf/checkpoint_loader.py:
  `@register_checkpoint_loader("HF") class HfCheckpointLoader(BaseCheckpointLoader)` with
  keyword-only `weight_loader=`, `weight_mapper=`, `config_loader=`;
  base_weight_loader.py: `BaseWeightLoader.load_weights(checkpoint_dir) -> dict[str, Any]`.
* tensorrt_llm/llmapi/llm_args.py: `TorchLlmArgs.checkpoint_loader` (an instance of a
  `BaseCheckpointLoader` subclass) and `checkpoint_format`.

What the hook does. `KvholdCheckpointLoader` is an `HfCheckpointLoader` whose weight loader
returns the tensors of the sidecar's sealed weights region (views, already on the GPU with
the cuda backend) instead of reading safetensors: a replacement executor reads nothing from
disk. TensorRT-LLM then copies them into its own parameters (it fuses q/k/v and gate/up, so
those must be copies). Right after that copy, `rebind_views` replaces every parameter that is
the checkpoint tensor unchanged (same name, shape, dtype and bytes: embeddings, norms,
o_proj, down_proj, lm_head) by the region's view and frees the private copy; what
TensorRT-LLM transformed stays private. (A "GPU memory service" load format that keeps
parameters in external memory, the meta-init + replace-parameters route, is proposed for later
TensorRT-LLM versions; the `LoadFormat`s of the version read are AUTO, DUMMY and VISION_ONLY,
none of which takes foreign parameter storage, so this hook goes through the checkpoint loader.)
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping

import torch
from torch import nn

from kvhold.executor.materialize import materialize

log = logging.getLogger(__name__)


def rebind_views(model: nn.Module, region: Mapping[str, torch.Tensor], compare: bool = True) -> list[str]:
    """Replace parameters equal to a region tensor of the same name by that tensor (a view).

    A parameter qualifies when the region has its name with the same shape and dtype and,
    with `compare`, the same bytes (so a tensor the engine rescaled, sharded or fused is never
    swapped). Returns the rebound names; everything else is left as it is."""
    same = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        t = region.get(name)
        if t is None or tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype or t.device != p.device:
            continue
        if compare and not torch.equal(t, p.detach()):
            continue
        same[name] = t
    if same:
        materialize(model, same, strict=False)
    log.info("%d of %d parameters now view the kvhold weights region",
             len(same), sum(1 for _ in model.parameters()))
    return sorted(same)


LOAD_KEYWORDS = ("weight_mapper", "allow_partial_loading")   # what _call_load_weights inspects


def explicit_signature(load: Callable, after: Callable[[], None]) -> Callable:
    """A wrapper of `load(weights, ...)` that calls `after()` once it returns, and whose
    `inspect.getfullargspec(...).args` names exactly the keywords of `LOAD_KEYWORDS` that
    `load` names: TensorRT-LLM decides what to pass by reading those names."""
    spec = inspect.getfullargspec(load)
    names = [k for k in LOAD_KEYWORDS if k in spec.args]      # what TensorRT-LLM reads

    def call(weights, **kwargs):
        out = load(weights, **kwargs)
        after()
        return out

    if names == ["weight_mapper", "allow_partial_loading"]:
        def load_then_rebind(weights, weight_mapper=None, allow_partial_loading=False):
            return call(weights, weight_mapper=weight_mapper, allow_partial_loading=allow_partial_loading)
    elif names == ["weight_mapper"]:
        def load_then_rebind(weights, weight_mapper=None):
            return call(weights, weight_mapper=weight_mapper)
    elif names == ["allow_partial_loading"]:
        def load_then_rebind(weights, allow_partial_loading=False):
            return call(weights, allow_partial_loading=allow_partial_loading)
    else:
        def load_then_rebind(weights):
            return call(weights)
    load_then_rebind.__doc__ = getattr(load, "__doc__", None)
    return load_then_rebind


def region_weights(region) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by Hugging Face name, as views of the region."""
    return region.tensors() if hasattr(region, "tensors") else dict(region)


def wrap_load(loader, model) -> None:
    """Replace `model.load_weights` (ModelLoader looks it up after the mapper is made) by one
    that rebinds unchanged parameters to the region once TensorRT-LLM has loaded them."""
    def after():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        loader.rebound = rebind_views(model, region_weights(loader.region))

    model.load_weights = explicit_signature(model.load_weights, after)


try:
    from tensorrt_llm._torch.models.checkpoints.base_weight_loader import (
        BaseWeightLoader,
    )
    from tensorrt_llm._torch.models.checkpoints.hf.checkpoint_loader import (
        HfCheckpointLoader,
    )
except ImportError:                          # pragma: no cover - exercised where it is installed
    BaseWeightLoader = HfCheckpointLoader = None


if HfCheckpointLoader is not None:

    class KvholdWeightLoader(BaseWeightLoader):
        """Weights come from the sidecar's sealed region, not from checkpoint files."""

        def __init__(self, region):
            self.region = region

        def load_weights(self, checkpoint_dir: str, **kwargs) -> dict:
            return region_weights(self.region)

    class KvholdCheckpointLoader(HfCheckpointLoader):
        """`LLM(checkpoint_loader=KvholdCheckpointLoader(region))`: HF config and mapper, kvhold
        weights, and parameters rebound to the region after TensorRT-LLM's load."""

        def __init__(self, region, rebind: bool = True):
            super().__init__(weight_loader=KvholdWeightLoader(region))
            self.region, self.rebind = region, rebind
            self.rebound: list[str] = []

        def get_initialized_weight_mapper(self, model, config):
            mapper = super().get_initialized_weight_mapper(model, config)
            if self.rebind:
                self._wrap_load(model)
            return mapper

        def _wrap_load(self, model) -> None:
            wrap_load(self, model)
