"""DSpark block drafters for Kimi K3 / Kimi Linear targets, in the published checkpoints' layout."""
