"""Everything about bytes on disk: step files (Zarr v3 in a stored ZIP), commit manifests,
refs. Knows no torch. Its public line is what a user of the store API needs (docs/store-api.md,
docs/api.md): a run and its bytes (``Repository``, ``Reader``, ``Storage``, ``LocalStorage``,
``storage_for``, ``CommitHeader``, ``ArrayRecord``); whole steps (``save``, ``load``,
``StoredStep``); fewer bytes (``DeltaPolicy``, ``adam_predictions``, ``sgd_predictions``);
keeping fewer steps (``Retention``, ``GcReport``).

The rest (the step-writer contract, the flat lane, the flusher, several ranks, the index's
rows, ...) is private: dstt reaches it through ``dstt.store._internal``, and the rooms
(``storage``, ``format``, ``codec``, ...) are private too. Rejected alternative: one door for
both — it exported 72 names, hot-path internals among them, which a user could not tell from
the API. Names resolve on first use (PEP 562): reading a run loads no writer.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .api import StoredStep, load, save
    from .codec.predict import adam_predictions, sgd_predictions
    from .codec.xor import DeltaPolicy
    from .format.records import ArrayRecord, CommitHeader
    from .maintenance.gc import GcReport
    from .maintenance.retention import Retention
    from .read.reader import Reader
    from .repository import Repository
    from .storage.base import Storage
    from .storage.local import LocalStorage
    from .storage.urls import storage_for


__all__ = [
    "ArrayRecord",
    "CommitHeader",
    "DeltaPolicy",
    "GcReport",
    "LocalStorage",
    "Reader",
    "Repository",
    "Retention",
    "Storage",
    "StoredStep",
    "adam_predictions",
    "load",
    "save",
    "sgd_predictions",
    "storage_for",
]

_LAZY: dict[str, tuple[str, str]] = {
    "ArrayRecord": ("format.records", "ArrayRecord"),
    "CommitHeader": ("format.records", "CommitHeader"),
    "DeltaPolicy": ("codec.xor", "DeltaPolicy"),
    "GcReport": ("maintenance.gc", "GcReport"),
    "LocalStorage": ("storage.local", "LocalStorage"),
    "Reader": ("read.reader", "Reader"),
    "Repository": ("repository", "Repository"),
    "Retention": ("maintenance.retention", "Retention"),
    "Storage": ("storage.base", "Storage"),
    "StoredStep": ("api", "StoredStep"),
    "adam_predictions": ("codec.predict", "adam_predictions"),
    "load": ("api", "load"),
    "save": ("api", "save"),
    "sgd_predictions": ("codec.predict", "sgd_predictions"),
    "storage_for": ("storage.urls", "storage_for"),
}


def __getattr__(name: str) -> object:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(
            f"module 'dstt.store' has no attribute {name!r}"
            " (dstt's internal names are in the private dstt.store._internal)"
        ) from None
    value = getattr(_importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
