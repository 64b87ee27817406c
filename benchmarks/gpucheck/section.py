"""One section of the GPU one-shot, in its own process:
``python -m benchmarks.gpucheck.section NAME ROWS_FILE SECONDS``.

The parent (``benchmarks/gpu_check.py``) sets the environment (device emulation or not, the
fla-core wheel on ``PYTHONPATH``) and kills this process if it overruns ``SECONDS``; rows already
appended to ROWS_FILE survive either way.
"""

from __future__ import annotations

import sys

from benchmarks.gpucheck.common import Deadline, Mode, Sink


def kernels(mode, sink) -> None:
    import torch

    from benchmarks.gpucheck import big_ops, small_ops

    for name, check in small_ops.CHECKS + big_ops.CHECKS:
        sink.run(name, check, mode)
        if mode.device.type == "cuda":
            torch.cuda.empty_cache()  # the MoE checks each hold tens of GB of experts


def model_k2(mode, sink) -> None:
    from benchmarks.gpucheck.model_checks import k2_rows

    k2_rows(mode, sink)


def model_k3(mode, sink) -> None:
    from benchmarks.gpucheck.model_checks import k3_rows

    k3_rows(mode, sink)


def offload(mode, sink) -> None:
    from benchmarks.gpucheck.offload_check import offload_rows

    offload_rows(mode, sink)


SECTIONS = {"kernels": kernels, "model-k2": model_k2, "model-k3": model_k3, "offload": offload}


def main(argv: list[str]) -> int:
    name, rows_file, seconds = argv[0], argv[1], float(argv[2])
    mode = Mode.from_env()
    if mode.device.type == "cuda":
        import torch

        torch.cuda.set_device(mode.device)
    sink = Sink(rows_file, name, Deadline(seconds - 5))  # 5 s to spare before the parent's kill
    SECTIONS[name](mode, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
