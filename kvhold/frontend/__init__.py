"""The client-facing frontend as its own process (`kvhold frontend`): kvhold.frontend.process."""
