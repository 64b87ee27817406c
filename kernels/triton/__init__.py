"""Triton kernels (GPU, or the interpreter): one file per kernel, each a private @triton.jit and a checking wrapper; backend.py puts them behind the Backend interface."""
