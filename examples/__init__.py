"""Runnable examples: existing JAX training loops made elastic in a few lines (see examples/README.md)."""
