"""What the sidecar, executors and clients share: tables, wire protocol, memory, SDK."""
