"""Benchmarks and the GPU one-shot (``benchmarks/gpu_check.py``), run from the source tree.

A regular package, not a namespace one: a namespace package loses to any installed top-level
``benchmarks`` package (some wheels ship one), and ``benchmarks.gpucheck`` would then not import.
"""
