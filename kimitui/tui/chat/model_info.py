"""What the model panel shows, read once from a loaded ``AsyncLLM`` through its public attributes."""

from __future__ import annotations

from dataclasses import dataclass

from kimitui.engine.plan.param_count import CacheLayout, cache_layout, count_params, meta_model

DEMO_NOTE = "random weights: output is noise"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    is_demo: bool
    parameters: int | None
    precision: str
    num_gpus: int
    device: str
    experts: str
    max_model_len: int | None
    num_layers: int | None
    num_routed_experts: int | None
    cache: CacheLayout | None = None  # KDA / MLA layer counts and per-sequence cache bytes
    remote: str | None = None  # the server's URL and kind when the model runs elsewhere


def remote_info(name: str, url: str, server: str, max_model_len: int | None, num_gpus: int) -> ModelInfo:
    """A model served at ``url``: only what the server says about it (name, context length);
    our own demo served by `kimitui serve` is still marked as noise."""
    return ModelInfo(
        name=name,
        is_demo="kimitui-demo" in name or name in ("demo", "demo-k3"),
        parameters=None,
        precision="n/a",
        num_gpus=num_gpus,
        device=url,
        experts="n/a",
        max_model_len=max_model_len,
        num_layers=None,
        num_routed_experts=None,
        remote=f"{url} ({server})",
    )


def remote_lines(info: ModelInfo) -> list[str]:
    """The model panel for a remote model: what the server told us, marked remote."""
    gpus = str(info.num_gpus) if info.num_gpus else "n/a (--num-gpus N or --telemetry-url)"
    context = f"{info.max_model_len:,} tokens" if info.max_model_len else "n/a"
    return [info.name, f"REMOTE   {info.remote}", f"context  {context}", f"GPUs     {gpus}"]


def model_info(llm, num_gpus: int) -> ModelInfo:
    """Build the panel data; every attribute is optional so a partial engine still shows."""
    config = llm.config
    engine = getattr(llm, "engine", None)
    device = str(getattr(engine, "device", "n/a"))
    try:
        # Logical weights from the config: a packed INT4 or MXFP4 tensor holds several per element.
        # One meta build (shapes only) serves the count and the cache layout.
        model = meta_model(config)
        params, cache = count_params(config, model).total.params, cache_layout(config, model)
    except Exception:  # a config the planner cannot size simply has no count
        params, cache = None, None
    return ModelInfo(
        name=getattr(config, "name", "") or "model",
        is_demo=bool(getattr(config, "is_demo", False)),
        parameters=params,
        precision=_precision(config, engine),
        num_gpus=num_gpus if device.startswith("cuda") else 0,
        device=device,
        experts=_experts(getattr(engine, "expert_placement", None), device),
        max_model_len=getattr(engine, "max_model_len", None),
        num_layers=getattr(config, "num_hidden_layers", None),
        num_routed_experts=getattr(config, "n_routed_experts", None),
        cache=cache,
    )


def architecture_lines(cache: CacheLayout | None) -> list[str]:
    """The panel's layer and cache lines: KDA + MLA counts and the state per sequence for a hybrid
    (Kimi Linear / K3), the MLA layer count and per-token latent bytes for an all-MLA model (K2)."""
    if cache is None:
        return []
    kv = f"KV       {cache.kv_bytes_per_token / 1024:.1f} KiB/token (MLA latent)"
    if not cache.num_state_layers:
        return [f"layers   {cache.num_paged_layers} MLA", kv]
    return [
        f"layers   {cache.num_state_layers} KDA + {cache.num_paged_layers} MLA "
        f"(KDA state {cache.state_bytes_per_seq / 2**20:.1f} MiB/seq)",
        kv,
    ]


def _precision(config, engine) -> str:
    compute = str(getattr(engine, "dtype", "")).replace("torch.", "") or "n/a"
    stored = getattr(config, "torch_dtype", None)
    quant = getattr(config, "quantization", None)
    parts = [f"compute {compute}"]
    if stored:
        parts.append(f"weights {stored}")
    if quant is not None:
        parts.append(f"quant {getattr(quant, 'method', quant)}")
    return ", ".join(parts)


def _experts(placement, device: str) -> str:
    """``placement``: the engine's ``expert_placement`` rows ([layer][expert] -> rank, -1 = host RAM)."""
    rows = placement if isinstance(placement, list) else getattr(placement, "expert_device", None)
    if not rows:
        return f"all on {device}"
    where = [d for row in rows for d in row]
    on_cpu = sum(1 for d in where if d < 0)
    kind = "GPU" if device.startswith("cuda") else device
    devices = len({d for d in where if d >= 0})
    if on_cpu == 0:
        return f"all on {kind} ({devices} device{'s' if devices != 1 else ''})"
    if on_cpu == len(where):
        return "all in host RAM (CPU)"
    return f"{len(where) - on_cpu} on {kind}, {on_cpu} in host RAM (CPU)"
