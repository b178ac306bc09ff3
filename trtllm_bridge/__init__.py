"""TensorRT-LLM adapter (issue 7): not implemented yet."""
