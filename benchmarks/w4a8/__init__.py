"""W4A8 expert products on the CPU: the experts-alone A/B (experts_ab.py)."""
