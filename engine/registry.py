"""Model families: ``config.json``'s ``model_type`` -> the class that builds the model.

Nothing outside this module tests ``model_type``. A family says how its config wraps the text model
(``text_config``) and which prefix its checkpoint puts on the text model's tensors; the class says
everything else. A registered model class is an ``nn.Module`` that provides:

``cls(config, dtype, max_position=None, par=SINGLE, expert_placement=None)``
    Builds this rank's share of the weights on the current torch device (the loader uses the target
    device, the planner ``torch.device("meta")``), every parameter with an explicit dtype: dense
    weights in ``dtype``, quantised storage in its own dtypes, fp32-by-contract tensors (FP8 scales,
    router weight and correction bias, KDA ``A_log`` / ``dt_bias``) in fp32 whatever ``dtype`` is.
    The process default dtype is never touched. Parameters sharded over ranks record ``full_shape``,
    ``shard`` and the like (see ``engine.loader.source``).
``model.checkpoint_target(name) -> WeightTarget | str``
    The checkpoint name mapping, for a name with the family's prefix already removed: the module
    and the name within it that take the tensor, plus a shard id for modules that assemble one
    parameter from several tensors (an expert index), or a string saying why the tensor is skipped
    (it is counted in the load report). The module's ``load_weight(name, shard_id, src)``, when it
    has one, takes the tensor and returns the ``(parameter, shard id)`` pairs it filled (None: not a
    name it has); otherwise the parameter of that name is copied (``copy_into``). A parameter made
    of several tensors declares how many (``param.num_sources``) and, through ``param.sources()``,
    which ({shard id: checkpoint name}) so a missing one is named; a parameter with
    ``param.optional`` may be absent.
``model.cache_specs(dtype) -> list[CacheSpec]``
    One per layer, in layer order: ``MLACacheSpec`` (paged latent) or ``KDAStateSpec`` (state slot).
Parameter classes for the planner
    A module class (or instance) sets ``param_class`` to one of ``PARAM_CLASSES``; a parameter
    belongs to the class of the closest enclosing module that sets one (``parameter_classes``).
    The planner sums the bytes of a meta-device build grouped this way, so what it counts is what
    the engine allocates.
``model.forward(input_ids, meta, caches)``, ``model.compute_logits(hidden)``, ``model.post_load(ops)`` (after ``loader.finish_load`` hands every module its backend),
``model.routing_stats()``
    Running the model, as ``engine.runner`` calls it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

PARAM_CLASSES = (
    "embedding",
    "lm_head",
    "final_norm",
    "attention",
    "dense_mlp",
    "router",
    "shared_experts",
    "routed_experts",
)


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    model_class: str  # "module:Class", imported on first use so reading a config needs no torch
    text_config: str | None = None  # key of the text model's config inside a multimodal wrapper
    weight_prefix: str = ""  # prefix of the text model's tensors in the checkpoint
    text_model_type: str | None = None  # the model_type a wrapper's text_config must have, if any


@dataclass(frozen=True)
class WeightTarget:
    """Where one checkpoint tensor goes: ``module`` (dotted path in the model), ``name`` within it."""

    module: str
    name: str
    shard_id: Any = None


_DEEPSEEK_V3 = "kimitui.engine.models.deepseek_v3:DeepseekV3ForCausalLM"
_KIMI_LINEAR = "kimitui.engine.models.kimi_linear:KimiLinearForCausalLM"
FAMILIES: dict[str, ModelFamily] = {
    f.model_type: f
    for f in (
        ModelFamily("kimi_k2", _DEEPSEEK_V3),
        ModelFamily("deepseek_v3", _DEEPSEEK_V3),
        ModelFamily("kimi_k25", _DEEPSEEK_V3, text_config="text_config", weight_prefix="language_model."),
        ModelFamily("kimi_linear", _KIMI_LINEAR),
        ModelFamily(
            "kimi_k3",
            _KIMI_LINEAR,
            text_config="text_config",
            weight_prefix="language_model.",
            text_model_type="kimi_linear",
        ),
    )
}


def supported_model_types() -> tuple[str, ...]:
    return tuple(FAMILIES)


def model_family(model_type: str) -> ModelFamily | None:
    return FAMILIES.get(model_type)


def model_class(model_type: str) -> type:
    """The class that builds a model of ``model_type``."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(supported_model_types())})"
        )
    module, name = family.model_class.split(":")
    return getattr(importlib.import_module(module), name)


def parameter_classes(model: "nn.Module") -> dict[str, str]:
    """{parameter name: planner class} for every parameter of ``model`` (tied ones once)."""
    owner: dict[str, str | None] = {}
    for name, module in model.named_modules():
        declared = getattr(module, "param_class", None)
        parent = owner.get(name.rpartition(".")[0]) if name else None
        owner[name] = declared or parent
    out = {}
    for name, _ in model.named_parameters():
        cls = owner[name.rpartition(".")[0]]
        if cls not in PARAM_CLASSES:
            raise ValueError(f"parameter {name} declares no planner class (set param_class on its module)")
        out[name] = cls
    return out
