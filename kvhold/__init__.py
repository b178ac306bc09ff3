"""kvhold: keep an LLM server's GPU memory alive when its inference engine dies."""
__version__ = "0.1.0"
