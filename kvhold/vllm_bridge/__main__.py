"""`python -m kvhold.vllm_bridge`: one kvhold executor whose workload is a vLLM engine.

The sidecar spawns this (instead of `python -m kvhold.executor`) when its executors run the
`vllm` workload; it takes the same arguments."""
import sys

from kvhold.vllm_bridge.workload import main

sys.exit(main())
