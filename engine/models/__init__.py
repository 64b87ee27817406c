"""Model families and the declarations the engine builds from; see ``engine.registry``."""

from kimitui.engine.registry import (
    PARAM_CLASSES,
    ModelFamily,
    WeightTarget,
    model_class,
    model_family,
    parameter_classes,
    supported_model_types,
)

__all__ = [
    "PARAM_CLASSES",
    "ModelFamily",
    "WeightTarget",
    "model_class",
    "model_family",
    "parameter_classes",
    "supported_model_types",
]
