"""The GPU one-shot check, split by section (entry point: benchmarks/gpu_check.py)."""
