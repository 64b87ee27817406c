"""Input checks shared by the Triton kernel wrappers."""

import os

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # activations every kernel takes


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def check_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and that device a GPU (or the interpreter is on)."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    if device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need a CUDA/ROCm tensor (or TRITON_INTERPRET=1), got {device}")
