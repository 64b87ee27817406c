"""Test-wide settings: nothing touches the user's real cache, config or data dirs, nothing downloads.

The one exception is the build cache of the C++ CPU kernels (kernels/cpu/few_rows.py): it stays where
torch keeps it, so the suite compiles them once per machine rather than once per run (about 30 s).
"""

import os
import tempfile

if "TORCH_EXTENSIONS_DIR" not in os.environ:  # before XDG_CACHE_HOME moves below: torch's root follows it
    from kimitui.kernels.cpu.build import extensions_root  # so the tests reuse the builds `make` and the app made

    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root())
_ROOT = tempfile.mkdtemp(prefix="kimitui-tests-")
for _var, _sub in (("XDG_CACHE_HOME", "cache"), ("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data")):
    os.environ[_var] = os.path.join(_ROOT, _sub)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _kimi_linear_oracle_without_fla() -> None:
    """transformers' Kimi Linear (the KDA oracle) swaps in fla-core's Triton kernels when ``fla``
    imports, which it does since fla-core is a test extra (tests/kernels/triton/test_fla_interpret.py runs
    it interpreted, in child processes). On a machine without a GPU those kernels have no driver, and
    the oracle should be transformers' own PyTorch path anyway: import its modeling module once
    with ``fla`` hidden, so its kernels bind to the PyTorch functions."""
    import importlib.util
    import sys

    if importlib.util.find_spec("fla") is None:
        return
    had = "fla" in sys.modules
    saved = sys.modules.get("fla")
    sys.modules["fla"] = None  # import fla -> ImportError
    try:
        import transformers.models.kimi_linear.modeling_kimi_linear  # noqa: F401
    except ImportError:
        pass  # a transformers without Kimi Linear: the oracle tests skip themselves
    finally:
        if had:
            sys.modules["fla"] = saved
        else:
            del sys.modules["fla"]


_kimi_linear_oracle_without_fla()
