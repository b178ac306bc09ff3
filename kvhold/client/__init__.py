"""The client SDK: submit requests to a sidecar over ZeroMQ and stream their tokens (sync and asyncio)."""
