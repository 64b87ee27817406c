"""The GPU one-shot: on one CUDA/ROCm GPU, in under 8 minutes, the GPU tests, every Triton kernel
against its PyTorch reference at Kimi's shapes, graph capture of the decode step and decode tok/s
of Kimi-shaped random models, printed as one table (and written to $OUT/gpu_check.md and .json).

    PYTHONPATH=. python3 benchmarks/gpu_check.py [--emulate] [--sections tests,kernels,...]

Without a GPU (or with --emulate) it runs the same sections on the CPU with the device path
emulated, at toy sizes: a self-test of the script, no GPU numbers. See benchmarks/README.md.
The sections live in benchmarks/gpucheck/.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, as a plain script

from benchmarks.gpucheck.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
