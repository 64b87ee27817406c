"""The built-in demo checkpoints: small random-weight models in the real on-disk layouts of Kimi K2
(``demo``, ``k2.py``) and Kimi K3 (``demo-k3``, ``k3.py``), written on first use into the cache dir."""

from __future__ import annotations

from pathlib import Path

from kimitui.engine.demo.k2 import demo_dir, ensure_demo_checkpoint, write_demo_checkpoint
from kimitui.engine.demo.k3 import ensure_demo_k3_checkpoint

WRITERS = {"demo": ensure_demo_checkpoint, "demo-k3": ensure_demo_k3_checkpoint}
DEMO_MODELS = tuple(WRITERS)  # names --model / LLM(model=...) take for the built-in checkpoints

__all__ = ["DEMO_MODELS", "demo_checkpoint", "demo_dir", "ensure_demo_checkpoint", "write_demo_checkpoint"]


def demo_checkpoint(name: str | None = "demo") -> Path:
    """The built-in checkpoint called ``name`` ("demo", the K2-shaped one, or "demo-k3"), written on first use."""
    writer = WRITERS.get(name or "demo")
    if writer is None:
        raise ValueError(f"unknown built-in model {name!r} (expected one of {', '.join(DEMO_MODELS)})")
    return writer()
