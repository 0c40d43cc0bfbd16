"""The capture engine: what to capture, how to copy it, how to flush it. ``dstt.training``
drives it; the engine never imports ``dstt.inspect`` and reaches the disk only through
``dstt.store``. Its rooms, bottom up (each imports only the rooms before it; one step's
journey through them: docs/architecture.md):

``tensors`` one tensor (conversions, DTensors) · ``state`` what to capture (providers) ·
``capture`` copying and flushing one rank's steps (pipeline) · ``distributed`` several ranks
(DDP, FSDP2, TP) · ``ds`` DeepSpeed. Each room's ``__init__`` names its modules.

The names below are imported lazily (PEP 562): ``capture.light``, which a read of the index
needs (``dstt log``), must not pull in torch through ``pipeline``. Rejected alternative:
eager imports here — any submodule's import would cost torch's start (~1 s).
"""

from __future__ import annotations

from typing import TYPE_CHECKING as _TYPE_CHECKING

from dstt._lazy import lazy_names as _lazy_names

if _TYPE_CHECKING:
    from .capture.pipeline import Pipeline, StepMetrics
    from .state.data_position import DataPosition, TrackedData
    from .state.providers import (
        CompositeProvider,
        ObjectProvider,
        RestoreSource,
        StateProvider,
        StoreSource,
        TensorProvider,
        TensorSpec,
    )
    from .state.torch_state import Stateful, TorchState, discover

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
    "DataPosition": "state.data_position",
    "TrackedData": "state.data_position",
    "Pipeline": "capture.pipeline",
    "StepMetrics": "capture.pipeline",
    "CompositeProvider": "state.providers",
    "ObjectProvider": "state.providers",
    "RestoreSource": "state.providers",
    "StateProvider": "state.providers",
    "StoreSource": "state.providers",
    "TensorProvider": "state.providers",
    "TensorSpec": "state.providers",
    "Stateful": "state.torch_state",
    "TorchState": "state.torch_state",
    "discover": "state.torch_state",
}


__getattr__, __dir__ = _lazy_names(__name__, _HOME, __all__)
