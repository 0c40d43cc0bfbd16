"""The capture engine: what to capture (providers), how to copy it (staging), how to flush it
(pipeline). ``dstt.training`` drives it for plain PyTorch; the engine never imports
``dstt.inspect`` and reaches the disk only through ``dstt.store``."""

from .data_position import DataPosition, TrackedData
from .pipeline import Pipeline, StepMetrics
from .providers import (
    CompositeProvider,
    ObjectProvider,
    RestoreSource,
    StateProvider,
    StoreSource,
    TensorProvider,
    TensorSpec,
)
from .torch_state import Stateful, TorchState, discover

__all__ = [
    "CompositeProvider",
    "DataPosition",
    "ObjectProvider",
    "Pipeline",
    "RestoreSource",
    "StateProvider",
    "Stateful",
    "StepMetrics",
    "StoreSource",
    "TensorProvider",
    "TensorSpec",
    "TorchState",
    "TrackedData",
    "discover",
]
