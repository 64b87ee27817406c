"""The parts of the build pyproject.toml cannot say: the package map and the C++ CPU kernels.

Package map: the distribution installs one import name, ``kimitui``. The repository's top-level folders
``engine/``, ``kernels/`` and ``themes/`` are the packages ``kimitui.engine``, ``kimitui.kernels`` and
``kimitui.themes``; their ``__init__.py`` files live under ``kimitui/`` (so that from the repository
root a bare ``kernels`` is never ours) and are copied in beside the folder's modules here.

C++ kernels: compiled with torch's extension helper against the torch in the build environment, so
build without isolation (``pip install --no-build-isolation .``, as ``make venv`` does) to compile
against the torch you run. Without torch at build time the wheel carries the sources only and the
kernels compile on first use instead (announced; ``kernels/cpu/build.py``). ``KIMITUI_BUILD_CPU_KERNELS=0``
skips them; ``KIMITUI_BUILD_CPU_KERNELS=this`` builds only the variant this machine's CPU runs (``make venv``
does, for a development install: a venv moved to another CPU compiles that one's variant on first use).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
FOLDERS = ("engine", "kernels", "themes")  # top-level folder -> kimitui.<folder>


def _load_build_module():
    spec = importlib.util.spec_from_file_location("_kimitui_kernels_build", ROOT / "kernels" / "cpu" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def packages() -> tuple[list[str], dict[str, str]]:
    found = ["kimitui", *(f"kimitui.{p}" for p in find_packages(where="kimitui") if p not in FOLDERS)]
    package_dir = {"kimitui": "kimitui"}
    for folder in FOLDERS:
        found.append(f"kimitui.{folder}")
        package_dir[f"kimitui.{folder}"] = folder
        found += [f"kimitui.{folder}.{p}" for p in find_packages(where=folder)]
    return found, package_dir


class BuildPy(build_py):
    """Adds each mapped package's ``__init__.py`` from ``kimitui/<folder>/``."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        head, _, folder = package.partition(".")
        if head == "kimitui" and folder in FOLDERS:
            modules.append((package, "__init__", str(Path("kimitui", folder, "__init__.py"))))
        return modules

    def check_package(self, package, package_dir):  # the mapped folders have no __init__.py of their own
        head, _, folder = package.partition(".")
        if head == "kimitui" and folder in FOLDERS:
            return str(Path("kimitui", folder, "__init__.py"))
        return super().check_package(package, package_dir)


def extensions():
    """The C++ CPU kernels, every variant (kernels/cpu/build.py) or this CPU's only, or nothing when torch is absent."""
    which = os.environ.get("KIMITUI_BUILD_CPU_KERNELS", "1").strip().lower()
    if which in ("0", "false", "off"):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "kimitui: torch is not importable at build time (build isolation?): the C++ CPU kernels will compile "
            "on first use. `pip install --no-build-isolation .` compiles them now.",
            file=sys.stderr,
        )
        return [], {}
    build = _load_build_module()
    modules = []
    for ext in build.EXTENSIONS:
        for variant, _ in ext.variants:
            if which == "this" and variant != build.variant_for(ext):
                continue
            modules.append(
                CppExtension(
                    name=f"kimitui.kernels.cpu.{ext.module(variant)}",
                    sources=[f"kernels/cpu/csrc/{s}" for s in ext.sources],
                    extra_compile_args=build.variant_flags(ext, variant),
                    extra_link_args=["-fopenmp"],
                    optional=True,  # no compiler: the install still succeeds, the kernels compile (or not) on first use
                )
            )

    class BuildKernels(BuildExtension):
        """Writes each module's build key beside it (kernels/cpu/build.py reads it at run time). Objects go to
        one folder in build/ whatever the command (setuptools gives editable and wheel builds a fresh
        temporary one each), so ninja recompiles only what changed: a second install, or a wheel built
        after an editable install, links in seconds instead of compiling for minutes."""

        def finalize_options(self):
            super().finalize_options()
            tag = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"
            self.build_temp = str(ROOT / "build" / f"kernels-{tag}")

        def build_extensions(self):
            try:
                super().build_extensions()
            except Exception as e:  # no usable compiler (torch checks it before any extension)
                print(
                    f"kimitui: the C++ CPU kernels did not compile ({str(e).splitlines()[0] if str(e) else e!r}); "
                    "they will compile on first use, or the PyTorch path runs",
                    file=sys.stderr,
                )

        def build_extension(self, extension):
            module = extension.name.rsplit(".", 1)[1]
            base, self.build_temp = self.build_temp, str(Path(self.build_temp) / module)  # variants share sources
            try:
                super().build_extension(extension)
            except Exception as e:  # torch's ninja build raises RuntimeError, which setuptools' optional misses
                print(
                    f"kimitui: {module} did not compile ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                    "it will compile on first use, or the PyTorch path runs",
                    file=sys.stderr,
                )
                return
            finally:
                self.build_temp = base
            ext, variant = next((e, v) for e in build.EXTENSIONS for v, _ in e.variants if e.module(v) == module)
            targets = {Path(self.get_ext_fullpath(extension.name)).parent}
            if self.inplace or getattr(self, "editable_mode", False):  # the module is copied into kernels/cpu/ too
                targets.add(ROOT / "kernels" / "cpu")
            for folder in targets:
                build.write_key(folder / "_", ext, variant, torch.__version__, folder=ROOT / "kernels" / "cpu" / "csrc")

    return modules, {"build_ext": BuildKernels.with_options(use_ninja=True)}


_packages, _package_dir = packages()
_ext_modules, _cmdclass = extensions()
setup(
    packages=_packages,
    package_dir=_package_dir,
    ext_modules=_ext_modules,
    cmdclass={"build_py": BuildPy, **_cmdclass},
)
