"""The long-lived sidecar daemon: owns memory and tables, supervises executors."""
