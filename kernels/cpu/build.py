"""The C++ CPU extensions (``kimitui.kernels.cpu.few_rows``, ``kimitui.kernels.cpu.quant_moe``,
``kimitui.kernels.cpu.k3_decode``): what each
is built from, and how a process finds its build.

They are compiled when the package is built or installed (``setup.py`` reads ``EXTENSIONS`` from this
file), one module per *variant*: the few-row kernels' 8-wide loops are compiled for x86-64-v4 (AVX-512),
x86-64-v3 (AVX2, FMA, F16C) and plain x86-64, and the variant this CPU runs is picked at run time; the packed-expert
kernels carry a target pragma per instruction set path and choose at run time themselves, so one
portable build serves every CPU. Beside each module the build writes ``<module>.buildkey``: a hash
of the sources, headers, flags and torch version it was built from. A process imports the built
module only when that key is the one its own files and torch give; otherwise (a source checkout
with edited C++, a wheel built without torch, another torch) it compiles just in time, announced on
the log (and by the TUI's load screen, which asks ``pending_builds`` first), into a folder named by
the key under ``TORCH_EXTENSIONS_DIR``, holding an ``flock`` on ``<folder>.lock`` so that two
processes never build over each other. The kernel drops that lock when its holder dies, so a
killed build never blocks the next start; torch's own ``lock`` file, which a killed build leaves
behind, is removed by whoever holds the flock. No compiler: the caller gets None, one warning, and
keeps its PyTorch path.

This module imports nothing but the standard library at its top: ``setup.py`` loads it by path.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import logging
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent  # the built modules and their keys
CSRC = HERE / "csrc"  # the C++ sources and headers
PACKAGE = "kimitui.kernels.cpu"
KEY_SUFFIX = ".buildkey"
# one variant each needs of /proc/cpuinfo (x86-64-v3: what -march=x86-64-v3 may emit)
_X86_64_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_X86_64_V4 = _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Extension:
    """One C++ extension: sources and headers (file names in ``kernels/cpu/csrc/``), compile flags, and its
    variants (name -> extra flags), best first; ``needs`` maps a variant to the CPU flags it needs."""

    name: str
    sources: tuple[str, ...]
    headers: tuple[str, ...]
    cflags: tuple[str, ...]
    variants: tuple[tuple[str, tuple[str, ...]], ...]
    needs: tuple[tuple[str, frozenset[str]], ...] = ()
    minutes: float = 1.0  # about how long one variant takes on 2 cores, for the announcement

    def module(self, variant: str) -> str:
        return f"_{self.name}_{variant}"


_PORTABLE = (("portable", ()),)
# no implicit a * b + c fusing: the kernels fuse explicitly (fmadd), the same in every tile. No trapping
# maths: we read no floating-point exception flags, and without it GCC keeps a branch for a clamp
# (min / max) followed by arithmetic, so the exp / tanh loops (gated_act.h) do not vectorise on AVX2.
_FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp")

FEW_ROWS = Extension(
    name="cpu_few_rows",
    sources=(
        "cpu_few_rows.cpp",
        "cpu_mla_decode.cpp",
        "cpu_decode_block.cpp",
        "cpu_onednn_packed.cpp",
        "cpu_moe_amx.cpp",
    ),
    headers=(
        "cpu_few_rows.h",
        "cpu_packed_experts.h",
        "cpu_kda_decode.h",
        "gated_act.h",
        "cpu_parallel.h",
        "cpu_team.h",
        "cpu_amx.h",
    ),
    cflags=_FLAGS,
    # AVX-512 machines (Zen 4/5 EPYC, Xeon): v4 ran bf16 4-row products 1.5-1.9x faster than v3 on Zen 4
    # (benchmarks/cpu_variants.py), near -march=native
    variants=(
        ("x86_64_v4", ("-march=x86-64-v4", "-mtune=generic")),
        ("x86_64_v3", ("-march=x86-64-v3", "-mtune=generic")),
        ("x86_64", ("-march=x86-64",)),
    )
    if platform.machine() in ("x86_64", "AMD64")
    else _PORTABLE,
    needs=(("x86_64_v4", _X86_64_V4), ("x86_64_v3", _X86_64_V3)),
    minutes=1.5,
)
QUANT_MOE = Extension(
    name="cpu_quant_moe",
    sources=("cpu_quant_moe.cpp", "cpu_quant_moe_isa.cpp", "cpu_quant_moe_amx.cpp", "cpu_quant_moe_w4a8.cpp"),
    headers=(
        "cpu_quant_moe_common.h",
        "cpu_quant_moe_avx512.h",
        "cpu_packed_experts.h",
        "gated_act.h",
        "cpu_parallel.h",
        "cpu_team.h",
        "cpu_amx.h",
    ),
    cflags=_FLAGS,  # no -march: each path carries its own target pragma, the portable one runs anywhere
    variants=_PORTABLE,
    minutes=2.0,
)
K3_DECODE = Extension(
    name="cpu_k3_decode",
    sources=("cpu_k3_decode.cpp",),
    headers=("cpu_kda_decode.h", "cpu_parallel.h", "cpu_team.h", "gated_act.h"),
    # no -march: the hot loops carry target_clones, one build runs anywhere; OpenMP as the team's other users
    cflags=_FLAGS,
    variants=_PORTABLE,
    minutes=0.5,
)
EXTENSIONS = (FEW_ROWS, QUANT_MOE, K3_DECODE)


def cpu_flags() -> frozenset[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.split(":", 1)[1].split())


ENV_VARIANT = "KIMITUI_CPU_VARIANT"  # a variant name, or "native" (-march=native, compiled just in time)


def variant_for(ext: Extension, flags: frozenset[str] | None = None) -> str:
    """The best variant of ``ext`` this CPU runs, or the one ``KIMITUI_CPU_VARIANT`` names."""
    wanted = os.environ.get(ENV_VARIANT, "").strip()
    if wanted == "native" or wanted in dict(ext.variants):
        return wanted
    if wanted:
        raise ValueError(f"{ENV_VARIANT}={wanted!r}: expected native or one of {', '.join(dict(ext.variants))}")
    flags = cpu_flags() if flags is None else flags
    needs = dict(ext.needs)
    return next(name for name, _ in ext.variants if needs.get(name, frozenset()) <= flags)


def variant_flags(ext: Extension, variant: str) -> list[str]:
    return [*ext.cflags, *(("-march=native",) if variant == "native" else dict(ext.variants)[variant])]


def build_key(ext: Extension, variant: str, torch_version: str, folder: Path = CSRC) -> str:
    """What one build depends on: every source and header byte, the flags, torch's version."""
    python = f"{sys.implementation.cache_tag} {platform.machine()}"  # a build is for one interpreter ABI
    h = hashlib.sha256(
        f"{ext.name} {variant} {' '.join(variant_flags(ext, variant))} torch {torch_version} {python}".encode()
    )
    for name in (*ext.sources, *ext.headers):
        h.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return h.hexdigest()[:16]


def write_key(module_file: Path, ext: Extension, variant: str, torch_version: str, folder: Path = CSRC) -> Path:
    """The sidecar ``setup.py`` writes beside a module it built."""
    path = module_file.parent / (ext.module(variant) + KEY_SUFFIX)
    path.write_text(json.dumps({"key": build_key(ext, variant, torch_version, folder), "torch": torch_version}) + "\n")
    return path


# -- run time ----------------------------------------------------------------------------------------


def _search_path() -> list[Path]:
    package = importlib.import_module(PACKAGE)
    return [Path(p) for p in package.__path__]


def _prebuilt(ext: Extension, variant: str, key: str) -> str | None:
    """The import name of a build-time module whose key is ``key``, if there is one."""
    for folder in _search_path():
        sidecar = folder / (ext.module(variant) + KEY_SUFFIX)
        try:
            found = json.loads(sidecar.read_text()).get("key")
        except (OSError, ValueError):
            continue
        if found == key:
            return f"{PACKAGE}.{ext.module(variant)}"
    return None


def extensions_root() -> Path:
    """Where torch builds extensions: ``TORCH_EXTENSIONS_DIR``, else its default root (which follows
    ``XDG_CACHE_HOME``) and the python / accelerator folder under it, as ``torch.utils.cpp_extension``."""
    import torch  # optional here: setup.py loads this module before torch may be installed
    from torch.utils.cpp_extension import (
        get_default_build_root,
    )  # optional here: setup.py loads this module before torch may be installed

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    return Path(get_default_build_root()) / folder


def _locate(ext: Extension, torch_version: str) -> tuple[str, str, str | None]:
    """This CPU's variant of ``ext``, its build key, and the import name of the install's build of it
    (None when there is none with that key)."""
    variant = variant_for(ext)
    key = build_key(ext, variant, torch_version)
    return variant, key, _prebuilt(ext, variant, key)


def _jit_dir(ext: Extension, variant: str, key: str) -> Path:
    return extensions_root() / "kimitui" / f"{ext.name}_{variant}_{key}"


def pending_builds() -> list[str]:
    """The extensions this process would compile before its first use (none after an install):
    "<name> (about N min)" each, for a load screen to say before the wait. Never raises."""
    try:
        import torch  # optional here: setup.py loads this module before torch may be installed

        out = []
        for ext in EXTENSIONS:
            variant, key, name = _locate(ext, torch.__version__)
            if name is None and not _jit_built(ext, variant, key):
                out.append(f"{ext.name} (about {ext.minutes:g} min)")
        return out
    except Exception:
        return []


def describe() -> str:
    """One line for ``kimitui info``: each extension's variant and where its build comes from, without
    compiling or importing anything."""
    try:
        import torch  # optional here: setup.py loads this module before torch may be installed

        parts = []
        for ext in EXTENSIONS:
            variant, key, name = _locate(ext, torch.__version__)
            where = (
                "built at install"
                if name
                else "compiled earlier on first use"
                if _jit_built(ext, variant, key)
                else "compiles on first use"
            )
            parts.append(f"{ext.name} {variant} ({where})")
        return "; ".join(parts)
    except Exception as e:  # sources missing, an odd platform: say so rather than fail `kimitui info`
        return f"unknown ({type(e).__name__}: {e})"


def _jit_built(ext: Extension, variant: str, key: str) -> bool:
    return (_jit_dir(ext, variant, key) / f"kimitui_{ext.name}_{variant}_{key}.so").is_file()


class BuildLock:
    """An exclusive ``flock`` on ``<folder>.lock`` (the kernel releases it when the holder dies, so it
    cannot go stale); its holder writes its pid there so a waiter can say whom it waits for."""

    def __init__(self, folder: Path, log: logging.Logger, what: str):
        self.path, self.log, self.what = folder.with_name(folder.name + ".lock"), log, what

    def __enter__(self) -> "BuildLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            self.log.warning("%s: waiting for process %s, which is compiling it (%s)", self.what, holder, self.path)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)
        return self

    def __exit__(self, *exc) -> None:
        os.ftruncate(self.fd, 0)
        os.close(self.fd)  # closing drops the flock


def clear_stale_torch_lock(folder: Path, log: logging.Logger) -> None:
    """torch's ``FileBaton`` leaves ``<folder>/lock`` when its build is killed, and every later
    ``load`` then waits on it forever. Called with the ``BuildLock`` held: no live process of ours is
    building in ``folder``, so the file is stale."""
    stale = folder / "lock"
    if stale.exists():
        log.warning("removing %s, left by a build that was killed", stale)
        stale.unlink(missing_ok=True)


def load_extension(ext: Extension, log: logging.Logger, what: str) -> ModuleType | None:
    """``ext``'s module for this CPU: the one built at install when its key matches, else compiled
    now (announced, under the lock); None, with a warning naming ``what``, when it cannot be had."""
    try:
        import torch  # optional here: setup.py loads this module before torch may be installed

        variant, key, name = _locate(ext, torch.__version__)
        if name is not None:
            return importlib.import_module(name)
        return _compile(ext, variant, key, log, what)
    except Exception as e:  # no compiler or ninja, an unsupported platform, a broken build: the PyTorch path
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        log.warning("%s unavailable (%s); using the PyTorch path", what, reason)
        return None


def _compile(ext: Extension, variant: str, key: str, log: logging.Logger, what: str) -> ModuleType:
    from torch.utils.cpp_extension import (
        load,
    )  # optional here: setup.py loads this module before torch may be installed

    folder = _jit_dir(ext, variant, key)
    name = f"kimitui_{ext.name}_{variant}_{key}"
    with BuildLock(folder, log, what):
        clear_stale_torch_lock(folder, log)
        if not (folder / f"{name}.so").is_file():
            log.warning(
                "%s: not built for this checkout and torch %s; compiling the %s variant now (about %g min "
                "on 2 cores, once, into %s). `pip install --no-build-isolation -e .` builds it ahead of time.",
                what,
                _torch_version(),
                variant,
                ext.minutes,
                folder,
            )
        if shutil.which("ninja") is None:  # the ninja wheel's binary, when its venv is not on PATH
            import ninja  # optional here: setup.py loads this module before torch may be installed

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        folder.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        module = load(
            name=name,
            sources=[str(CSRC / s) for s in ext.sources],
            extra_cflags=variant_flags(ext, variant),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
        if time.monotonic() - started > 5:
            log.warning("%s: compiled in %.0f s", what, time.monotonic() - started)
        return module


def _torch_version() -> str:
    import torch  # optional here: setup.py loads this module before torch may be installed

    return torch.__version__
