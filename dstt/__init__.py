"""dstt: lazy asynchronous LLM training checkpoints you can travel through.

The public surface is imported lazily (PEP 562) so that ``import dstt`` — and the zarr
``bfloat16`` entry point, which imports ``dstt.store.bfloat16`` — pulls in neither torch nor
xarray until a name that needs them is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CaptureError,
    ChecksumError,
    CorruptRunError,
    CurrentTimelineError,
    DsttError,
    FormatVersionError,
    MetricNotFoundError,
    MissingFileError,
    NotARunError,
    OutputExistsError,
    RaceError,
    RankError,
    ReadOnlyRunError,
    RunLockedError,
    SchemaError,
    StepNotFoundError,
    StorageError,
    TensorNotFoundError,
    TimelineError,
    UnsafeObjectError,
)

__version__ = "0.1.0"

__all__ = [
    "CaptureError",
    "ChecksumError",
    "CorruptRunError",
    "CurrentTimelineError",
    "DeltaPolicy",
    "DsttError",
    "FormatVersionError",
    "MetricNotFoundError",
    "MissingFileError",
    "NotARunError",
    "OutputExistsError",
    "RaceError",
    "RankError",
    "ReadOnlyRunError",
    "Retention",
    "Run",
    "RunLockedError",
    "SchemaError",
    "Session",
    "SessionOptions",
    "Snapshot",
    "StepMetrics",
    "StepNotFoundError",
    "StorageError",
    "TensorNotFoundError",
    "TimelineError",
    "UnsafeObjectError",
    "__version__",
    "open",
    "plots",
    "session",
    "widgets",
]

_LAZY: dict[str, str] = {
    "Retention": "dstt.store:Retention",
    "Run": "dstt._run:Run",
    "Snapshot": "dstt._snapshot:Snapshot",
    "DeltaPolicy": "dstt.store.codec:DeltaPolicy",
    "Session": "dstt.training:Session",
    "SessionOptions": "dstt.training:SessionOptions",
    "StepMetrics": "dstt.engine.pipeline:StepMetrics",
    "open": "dstt._run:open_run",
    "plots": "dstt.plots",
    "session": "dstt.training:session",
    "widgets": "dstt.widgets",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, _, attr = _LAZY[name].partition(":")
        module = importlib.import_module(mod)
        value = getattr(module, attr) if attr else module
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dstt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    pass
