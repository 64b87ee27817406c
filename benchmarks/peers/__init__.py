"""Helpers of the side-by-side peer benchmarks (vs_llama_cpp.py, vs_vllm_cpu.py)."""
