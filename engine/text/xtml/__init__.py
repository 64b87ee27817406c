"""Kimi K3's XTML chat format: rendering, options, tool declarations, reply parsing."""
