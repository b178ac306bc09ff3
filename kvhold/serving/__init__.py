"""The OpenAI-compatible HTTP API over the client SDK, its metrics, and `kvhold serve`."""
