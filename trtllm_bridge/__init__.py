"""kvhold behind engines that own their memory (TensorRT-LLM first; issue 7).

Engine-agnostic layer, tested on CPU against real third-party model code:

* `trtllm_bridge.materialize`: point a meta-device `nn.Module` at the sidecar's
  read-only weights region (views, no copy); a replacement executor loads nothing.
* `trtllm_bridge.kv_mirror`: copy each committed block of the engine's own KV pool
  into a versioned, checksummed kvhold page, and restore the intact ones into a
  fresh engine's pool after a crash.

The TensorRT-LLM glue (weights loader hook, KV cache connector, launcher) builds on
these two and is not part of this package yet.
"""
