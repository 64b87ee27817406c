"""Continuous batching: which sequences run this step, with how many tokens (pure Python, no tensors)."""
