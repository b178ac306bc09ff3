"""kvhold behind TensorRT-LLM, an engine that owns its memory.

Engine-agnostic layer, tested on CPU against real third-party model code:

* `kvhold.executor.materialize`: point a meta-device `nn.Module` at the sidecar's
  read-only weights region (views, no copy); a replacement executor loads nothing.
* `kvhold.executor.kv_mirror`: copy each committed block of the engine's own KV pool
  into a versioned, checksummed kvhold page, and restore the intact ones into a
  fresh engine's pool after a crash.

The TensorRT-LLM 1.2 glue builds on these two: `trtllm_connector` (KV Cache Connector
classes over the mirror), `trtllm_weights` (checkpoint loader + rebind of parameters to
the weights region) and `launcher` (`python -m kvhold.trtllm_bridge.launcher`, an executor running
a TensorRT-LLM LLM). Its TensorRT-LLM-facing parts import `tensorrt_llm` lazily and have not
run against it (docs/TRTLLM_BRIDGE.md).
"""
