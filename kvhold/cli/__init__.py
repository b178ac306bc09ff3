"""The `kvhold` command: one subcommand per job (sidecar, serve, status, top, pool-restart, ...)."""
from kvhold.cli.main import main

__all__ = ["main"]
