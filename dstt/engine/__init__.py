"""The capture engine: what to capture (providers), how to copy it (staging), how to flush it
(pipeline). ``dstt.training`` drives it for plain PyTorch; the engine never imports
``dstt.inspect`` and reaches the disk only through ``dstt.store``.

The names below are imported lazily (PEP 562): ``dstt.engine.light``, which a read of the
index needs (``dstt log``), must not pull in torch through ``pipeline``. Rejected
alternative: eager imports here — any submodule's import would cost torch's start (~1 s).

Modules (one step's journey through them: docs/architecture.md):

* what to capture — ``providers`` (the ``StateProvider`` seam), ``torch_state`` (model,
  optimizer, scheduler, RNG), ``optimizers`` (optimizer state as arrays), ``model_names``
  (canonical and tied names), ``dims`` (dimension names), ``data_position`` (the loader's
  position), ``predictions`` (which arrays the store may predict);
* copying it — ``staging`` (batched copies, version guard), ``flatlane`` (the step's flat
  plan, its segments and the buffer ring), ``flight`` (one staged step and its metrics);
* flushing it — ``pipeline`` (copy thread, writers), ``flatwrite`` (the lane's writes,
  through the store's ``StepSink``), ``committer`` (commits in step order), ``summaries``
  (write-time summaries), ``governor`` (encode or write raw), ``light`` (light steps of
  ``every="auto"``);
* several ranks — ``ranks`` (rank channel, opening the run together), ``sharding`` (which box
  each rank writes), ``dtensors`` (DTensor local views, restore into any placement),
  ``parallel`` (DDP, FSDP2, tensor parallel);
* DeepSpeed — ``deepspeed`` (an engine's state per rank), ``zero`` (ZeRO 1-3 partitions),
  ``ds_checkpoint`` (a ``CheckpointEngine`` into a run), ``_ds_tags`` (one tag, one
  transaction), ``_statedict`` (state dicts as arrays plus a skeleton);
* ``_convert`` — torch <-> store conversions (dtype names, byte views).
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
