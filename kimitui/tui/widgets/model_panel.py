"""Model: name, parameters, precision, layer kinds and cache per sequence, GPUs, where the experts live;
the demo says it is noise."""

from __future__ import annotations

from textual.widgets import Static

from kimitui.tui.chat.model_info import DEMO_NOTE, ModelInfo, architecture_lines, remote_lines
from kimitui.tui.formatting import count


class ModelPanel(Static):
    def __init__(self, **kwargs) -> None:
        super().__init__("loading…", markup=False, **kwargs)

    def on_mount(self) -> None:
        self.border_title = "model"

    def show(self, info: ModelInfo) -> None:
        lines = (
            remote_lines(info)
            if info.remote
            else [
                info.name,
                f"params   {count(info.parameters)}  ({info.num_layers} layers, {info.num_routed_experts} experts)",
                f"precision {info.precision}",
                *architecture_lines(info.cache),
                f"GPUs     {info.num_gpus}  (device {info.device}, context {info.max_model_len})",
                f"experts  {info.experts}",
            ]
        )
        if info.is_demo:
            lines.append(f"DEMO: {DEMO_NOTE}")
        self.update("\n".join(lines))
        self.set_class(info.is_demo, "demo")
