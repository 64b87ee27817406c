"""require_triton: a GPU run without a working Triton is an error naming the package, unless the
user asked for the reference path. The device type is faked by argument; a missing or broken
package by a module name (fake packages written to a temporary import path)."""

import importlib.util
import sys
from dataclasses import dataclass

import pytest

from kimitui.kernels.triton.check import TritonUnavailableError, require_triton, triton_problem

HAVE_TRITON = importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class Settings:  # the fields of the run's kernel settings that require_triton reads
    kernels: str = "auto"
    emulate_device: bool = False


@pytest.fixture
def fake_packages(tmp_path, monkeypatch):
    """A package that raises on import, one too old, one without a ``language`` module."""
    for name, init in (
        ("kimitui_broken_triton", "raise OSError('libcuda.so.1: cannot open shared object file')\n"),
        ("kimitui_old_triton", "__version__ = '2.1.0'\n"),
        ("kimitui_hollow_triton", "__version__ = '3.9.0'\n"),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(init)
    (tmp_path / "kimitui_old_triton" / "language.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in list(sys.modules):
        top = name.split(".")[0]
        if top.startswith("kimitui_") and top.endswith("_triton"):
            sys.modules.pop(name)


@pytest.mark.parametrize(
    "package, reason",
    [
        ("kimitui_no_such_triton", "is not installed"),
        ("kimitui_broken_triton", "OSError: libcuda.so.1"),
        ("kimitui_old_triton", "version 2.1.0 is older than 3.0"),
        ("kimitui_hollow_triton", "importing it failed (ModuleNotFoundError"),
    ],
)
def test_gpu_without_working_triton_is_an_error_naming_the_package(package, reason, fake_packages):
    with pytest.raises(TritonUnavailableError) as info:
        require_triton("cuda", Settings(), package=package)
    message = str(info.value)
    assert f"'{package}' package" in message and reason in message, message
    assert "KIMITUI_KERNELS=reference" in message and "\n" not in message


@pytest.mark.parametrize("device", ["cuda", "cuda:3", "cpu"])
def test_reference_path_needs_no_triton(device, fake_packages):
    assert require_triton(device, Settings(kernels="reference"), package="kimitui_broken_triton") is False
    assert (
        require_triton(device, Settings(kernels="reference", emulate_device=True), package="kimitui_no_such_triton")
        is False
    )


def test_cpu_and_other_devices_need_no_triton(fake_packages):
    assert require_triton("cpu", Settings(), package="kimitui_no_such_triton") is False
    assert require_triton("meta", Settings(), package="kimitui_no_such_triton") is False


def test_device_emulation_needs_triton_too(fake_packages):
    with pytest.raises(TritonUnavailableError, match="device emulation .* 'kimitui_broken_triton' package"):
        require_triton("cpu", Settings(emulate_device=True), package="kimitui_broken_triton")


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_working_triton_passes():
    assert triton_problem("triton") is None
    assert require_triton("cuda:0", Settings()) is True  # no driver probe without a real GPU
    assert require_triton("cpu", Settings(emulate_device=True)) is True
