"""Failure, not silence: a GPU run without a working Triton stops with an error naming the package.

Without this check a CUDA/ROCm run whose ``triton`` is missing or broken (no compiler backend, a
wheel built for another torch) would quietly fall back to the PyTorch reference kernels and run many
times slower, with nothing telling the user why. ``require_triton`` is called once when the kernel
backend is chosen: it returns whether Triton kernels run, and raises ``TritonUnavailableError``
when they must but cannot, unless the user asked for the reference path (``KIMITUI_KERNELS=reference``,
i.e. ``settings.kernels == "reference"``).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

# As pyproject.toml pins (torch 2.4's Triton). Every kernel compiles there: the one that uses newer
# ops (kernels/triton/moe_align.py: tl.gather from 3.2, tl.histogram's mask from 3.4) takes portable forms
# below 3.4, tested by tests/kernels/triton/test_moe_align_portable.py.
MIN_VERSION = (3, 0)


class TritonUnavailableError(RuntimeError):
    """A GPU run needs Triton and it is missing or broken."""


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def triton_problem(package: str = "triton", check_driver: bool = False) -> str | None:
    """Why ``package`` cannot run Triton kernels here (None: it can).

    ``check_driver`` also asks Triton for its active GPU driver (only meaningful on a machine with a
    GPU: on a CPU-only machine Triton has no driver, by design).
    """
    if importlib.util.find_spec(package) is None:
        return "it is not installed"
    try:
        module = importlib.import_module(package)
        importlib.import_module(f"{package}.language")
    except Exception as e:  # a broken install fails in many ways: ImportError, OSError, RuntimeError...
        return f"importing it failed ({type(e).__name__}: {e})"
    version = getattr(module, "__version__", "0")
    if _version(version) < MIN_VERSION:
        return f"version {version} is older than {'.'.join(map(str, MIN_VERSION))}"
    if check_driver:
        try:
            module.runtime.driver.active.get_current_target()
        except Exception as e:
            return f"it has no working GPU driver ({type(e).__name__}: {e})"
    return None


def _install_hint(package: str) -> str:
    if package != "triton":
        return f"install '{package}'"
    if torch.version.hip is not None:
        return "install the 'pytorch-triton-rocm' wheel that matches your torch (it provides the 'triton' package)"
    return "install it with 'pip install triton' (the version your torch wheel was built with)"


def require_triton(device: torch.device | str, settings, package: str = "triton") -> bool:
    """Whether a model on ``device`` runs Triton kernels under ``settings``; raises when it must but cannot.

    ``settings``: the run's kernel settings (``kernels`` is "auto" or "reference";
    ``emulate_device`` sends a CPU run down the device path, Triton interpreted). A CPU run (not
    emulated) and the reference path need no Triton. ``package`` is the module to check (tests pass
    a fake one).
    """
    device = torch.device(device)
    if getattr(settings, "kernels", "auto") == "reference":
        return False
    emulated = device.type == "cpu" and getattr(settings, "emulate_device", False)
    if device.type != "cuda" and not emulated:
        return False
    # ask for the driver only where a GPU is really present (tests name "cuda" on CPU machines)
    problem = triton_problem(package, check_driver=device.type == "cuda" and torch.cuda.is_available())
    if problem is None:
        return True
    where = "device emulation (KIMITUI_EMULATE_DEVICE=1)" if emulated else f"the {device.type} device"
    raise TritonUnavailableError(
        f"{where} needs the '{package}' package for its kernels, but {problem}: {_install_hint(package)}, "
        "or set KIMITUI_KERNELS=reference to run the (much slower) PyTorch reference kernels"
    )
