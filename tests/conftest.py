"""Test-wide settings: nothing touches the user's real cache, config or data dirs, nothing downloads.

The one exception is the build cache of the C++ CPU kernels (kernels/cpu_few_rows.py): it stays where
torch keeps it, so the suite compiles them once per machine rather than once per run (about 30 s).
"""

import os
import tempfile

os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torch_extensions"))
_ROOT = tempfile.mkdtemp(prefix="kimitui-tests-")
for _var, _sub in (("XDG_CACHE_HOME", "cache"), ("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data")):
    os.environ[_var] = os.path.join(_ROOT, _sub)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
