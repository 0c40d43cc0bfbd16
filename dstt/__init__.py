"""dstt: lazy asynchronous LLM training checkpoints you can travel through.

The public surface is imported lazily (PEP 562) so that ``import dstt`` — and the zarr
``bfloat16`` entry point, which imports ``dstt.store.bfloat16`` — pulls in neither torch nor
xarray until a name that needs them is used. ``__version__`` too is computed on first use
(``importlib.metadata`` costs ~30 ms, a tenth of ``dstt ls``). Rejected alternative: eager
imports of the public names — ``import dstt`` would cost torch's and xarray's start (seconds).
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING as _TYPE_CHECKING

from .errors import (
    CaptureError,
    ChecksumError,
    ConfigError,
    CorruptRunError,
    CurrentTimelineError,
    DsttError,
    DsttWarning,
    FormatVersionError,
    MetricNotFoundError,
    MissingFileError,
    NotARunError,
    OutputExistsError,
    RaceError,
    RankError,
    RankLostError,
    ReadOnlyRunError,
    ReplayError,
    RunLockedError,
    SchemaError,
    SegmentError,
    SourceError,
    StepNotFoundError,
    StorageError,
    TensorNotFoundError,
    TimelineError,
    UnsafeObjectError,
)

if _TYPE_CHECKING:
    __version__: str

if _TYPE_CHECKING:  # the lazy names, as type checkers see them (``_LAZY`` imports them)
    from . import plots, widgets
    from .engine.capture.pipeline import StepMetrics
    from .integrations.imports import import_checkpoints
    from .run.opening import open_run as open
    from .run.run import Run
    from .run.snapshot import Snapshot
    from .store import Retention
    from .store.codec import DeltaPolicy
    from .training import Session, SessionOptions, session

__all__ = [
    "CaptureError",
    "ChecksumError",
    "ConfigError",
    "CorruptRunError",
    "CurrentTimelineError",
    "DeltaPolicy",
    "DsttError",
    "DsttWarning",
    "FormatVersionError",
    "MetricNotFoundError",
    "MissingFileError",
    "NotARunError",
    "OutputExistsError",
    "RaceError",
    "RankError",
    "RankLostError",
    "ReadOnlyRunError",
    "ReplayError",
    "Retention",
    "Run",
    "RunLockedError",
    "SchemaError",
    "SegmentError",
    "Session",
    "SessionOptions",
    "Snapshot",
    "SourceError",
    "StepMetrics",
    "StepNotFoundError",
    "StorageError",
    "TensorNotFoundError",
    "TimelineError",
    "UnsafeObjectError",
    "__version__",
    "import_checkpoints",
    "open",
    "plots",
    "session",
    "widgets",
]

_LAZY: dict[str, str] = {
    "Retention": "dstt.store:Retention",
    "Run": "dstt.run:Run",
    "Snapshot": "dstt.run:Snapshot",
    "DeltaPolicy": "dstt.store.codec:DeltaPolicy",
    "Session": "dstt.training:Session",
    "SessionOptions": "dstt.training:SessionOptions",
    "StepMetrics": "dstt.engine.capture.pipeline:StepMetrics",
    "import_checkpoints": "dstt.integrations.imports:import_checkpoints",
    "open": "dstt.run:open_run",
    "plots": "dstt.plots",
    "session": "dstt.training:session",
    "widgets": "dstt.widgets",
}


def __getattr__(name: str) -> object:
    if name == "__version__":
        from importlib import metadata  # ~30 ms: only when the version is asked for

        try:
            version = metadata.version("dstt")
        except metadata.PackageNotFoundError:  # a source tree that was never installed
            version = "0+unknown"
        globals()[name] = version
        return version
    if name in _LAZY:
        mod, _, attr = _LAZY[name].partition(":")
        module = _importlib.import_module(mod)
        globals()[name] = value = getattr(module, attr) if attr else module
        return value
    raise AttributeError(f"module 'dstt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
