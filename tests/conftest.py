"""Test-wide settings: nothing touches the user's real cache, config or data dirs, nothing downloads."""

import os
import tempfile

_ROOT = tempfile.mkdtemp(prefix="kimitui-tests-")
for _var, _sub in (("XDG_CACHE_HOME", "cache"), ("XDG_CONFIG_HOME", "config"), ("XDG_DATA_HOME", "data")):
    os.environ[_var] = os.path.join(_ROOT, _sub)
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
