"""The model panel's architecture lines: KDA + MLA layer counts and the KDA state per sequence for
Kimi K3, the MLA layer count and per-token latent for Kimi K2; and the panel rendering them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

from textual.app import App

from kimitui.engine.config import ModelConfig
from kimitui.tui.chat.model_info import architecture_lines, model_info
from kimitui.tui.widgets.model_panel import ModelPanel

CONFIGS = Path(__file__).resolve().parents[2] / "fixtures" / "configs"


def fake_llm(name: str, placement=None):
    config = ModelConfig.from_pretrained(CONFIGS / f"{name}.json")
    engine = SimpleNamespace(device="cuda:0", dtype="torch.bfloat16", expert_placement=placement, max_model_len=131072)
    return SimpleNamespace(config=config, engine=engine)


def test_k3_lines():
    # 24 MLA layers x (512 + 64) bf16 values per token; 69 KDA layers x fp32 state [96, 128, 128] plus the
    # q/k/v conv history [3 x 96 x 128, 3] per sequence.
    rows = [[0] * 600 + [-1] * 296 for _ in range(92)]
    info = model_info(fake_llm("kimi_k3", rows), num_gpus=4)
    assert info.cache.num_state_layers == 69 and info.cache.num_paged_layers == 24
    assert info.cache.state_bytes_per_seq == 69 * 4 * (96 * 128 * 128 + 3 * 96 * 128 * 3)
    assert architecture_lines(info.cache) == [
        "layers   69 KDA + 24 MLA (KDA state 443.1 MiB/seq)",
        "KV       27.0 KiB/token (MLA latent)",
    ]
    assert info.experts == f"{600 * 92} on GPU, {296 * 92} in host RAM (CPU)"


def test_k2_lines():
    info = model_info(fake_llm("kimi_k2_instruct"), num_gpus=8)
    assert info.cache.num_state_layers == 0 and info.cache.state_bytes_per_seq == 0
    assert architecture_lines(info.cache) == [
        "layers   61 MLA",
        f"KV       {61 * 576 * 2 / 1024:.1f} KiB/token (MLA latent)",
    ]


def test_panel_renders_the_lines():
    info = model_info(fake_llm("kimi_k3"), num_gpus=6)

    class PanelApp(App):
        def compose(self):
            yield ModelPanel(id="model-panel")

    async def run() -> str:
        app = PanelApp()
        async with app.run_test(size=(80, 20)) as pilot:
            panel = app.query_one(ModelPanel)
            panel.show(info)
            await pilot.pause()
            return str(panel.render())

    text = asyncio.run(run())
    assert "layers   69 KDA + 24 MLA (KDA state 443.1 MiB/seq)" in text
    assert "KV       27.0 KiB/token (MLA latent)" in text
    assert "experts  all on GPU" in text or "experts  all on cuda" in text
