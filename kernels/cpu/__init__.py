"""The CPU backend: C++ kernels (sources in csrc/, built by build.py and setup.py) and their Python wrappers."""
