"""What `kimitui eval kl` and the TUI's evaluation screen share to set up a KL run: the model's
folder and tokenizer, a one-line description of the engine under test, and the plain-path switch
for the float32 reference."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path


def model_dir(model: str | None) -> Path:
    """The checkpoint folder of ``--model`` (the built-in demos are written on first use)."""
    from kimitui.engine.demo import DEMO_MODELS, demo_checkpoint

    if model in (None, "", *DEMO_MODELS):
        return demo_checkpoint(model or "demo")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    return path


def checkpoint_tokenizer(folder: Path):
    """The checkpoint's own tokenizer, or None when it ships none."""
    from kimitui.engine.text.tokenizer import Tokenizer

    if (folder / "tokenizer.json").is_file() or (folder / "tiktoken.model").is_file():
        return Tokenizer.from_pretrained(folder)
    return None


def describe_engine(a) -> str:
    """One line naming the path under test: model, dtype and every setting that changes the numbers."""
    parts = [str(a.model or "demo"), f"dtype={a.dtype}"]
    if a.tensor_parallel_size > 1:
        parts.append(f"tensor-parallel={a.tensor_parallel_size}")
    if a.cpu_offload not in ("auto", "none"):
        parts.append(f"cpu-offload={a.cpu_offload}")
    if a.speculative_config:
        parts.append(
            f"speculative={json.dumps(a.speculative_config) if isinstance(a.speculative_config, dict) else a.speculative_config}"
        )
    if os.environ.get("KIMITUI_EMULATE_DEVICE", "").strip().lower() in ("1", "true", "on", "yes"):
        parts.append("emulated device path")
    if os.environ.get("KIMITUI_KERNELS", "").strip():
        parts.append(f"kernels={os.environ['KIMITUI_KERNELS']}")
    return " ".join(parts)


@contextmanager
def plain_path():
    """The reference loads on the plain path of this device: device emulation (read when a model
    loads) is for the path under test only."""
    saved = os.environ.get("KIMITUI_EMULATE_DEVICE")
    os.environ["KIMITUI_EMULATE_DEVICE"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("KIMITUI_EMULATE_DEVICE", None)
        else:
            os.environ["KIMITUI_EMULATE_DEVICE"] = saved
