"""The capture engine: what to capture (providers), how to copy it (staging), how to flush it
(pipeline). ``dstt.training`` drives it for plain PyTorch; the engine never imports
``dstt.inspect`` and reaches the disk only through ``dstt.store``.

The names below are imported lazily (PEP 562): ``dstt.engine.light``, which a read of the
index needs (``dstt log``), must not pull in torch through ``pipeline``. Rejected
alternative: eager imports here — any submodule's import would cost torch's start (~1 s).
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

if _TYPE_CHECKING:
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

_HOME = {
    "DataPosition": "data_position",
    "TrackedData": "data_position",
    "Pipeline": "pipeline",
    "StepMetrics": "pipeline",
    "CompositeProvider": "providers",
    "ObjectProvider": "providers",
    "RestoreSource": "providers",
    "StateProvider": "providers",
    "StoreSource": "providers",
    "TensorProvider": "providers",
    "TensorSpec": "providers",
    "Stateful": "torch_state",
    "TorchState": "torch_state",
    "discover": "torch_state",
}


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'dstt.engine' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
