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

from typing import TYPE_CHECKING

from dstt._lazy import lazy_names as _lazy_names

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

_HOME: dict[str, str] = {
    "ArrayRecord": "format.records",
    "CommitHeader": "format.records",
    "DeltaPolicy": "codec.xor",
    "GcReport": "maintenance.gc",
    "LocalStorage": "storage.local",
    "Reader": "read.reader",
    "Repository": "repository",
    "Retention": "maintenance.retention",
    "Storage": "storage.base",
    "StoredStep": "api",
    "adam_predictions": "codec.predict",
    "load": "api",
    "save": "api",
    "sgd_predictions": "codec.predict",
    "storage_for": "storage.urls",
}


__getattr__, __dir__ = _lazy_names(
    __name__,
    _HOME,
    __all__,
    hint=" (dstt's internal names are in the private dstt.store._internal)",
)
