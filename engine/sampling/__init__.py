"""Turning logits into tokens: the sampler, penalties, per-row parameters, n > 1 fan-out."""
