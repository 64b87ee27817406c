"""What the model panel shows, read once from a loaded ``AsyncLLM`` through its public attributes."""

from __future__ import annotations

from dataclasses import dataclass

from engine.offload.param_count import count_params

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


def model_info(llm, num_gpus: int) -> ModelInfo:
    """Build the panel data; every attribute is optional so a partial engine still shows."""
    config = llm.config
    engine = getattr(llm, "engine", None)
    device = str(getattr(engine, "device", "n/a"))
    try:
        # Logical weights from the config: a packed INT4 or MXFP4 tensor holds several per element.
        params = count_params(config).total.params
    except Exception:  # a config the planner cannot size simply has no count
        params = None
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
    )


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
