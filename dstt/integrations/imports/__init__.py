"""Importing checkpoints people already have: ``dstt.import_checkpoints`` / ``dstt import``.

Hugging Face Trainer folders, ``torch.save`` and safetensors files, DCP folders and DeepSpeed
tags (any world size), Lightning ``.ckpt`` files become committed steps laid out as the
capture engine lays out a step, so every view, ``export``, ``verify``, ``rollback`` and a
session resume work on an imported run. One reader per format turns the files, each read by
its framework's own reader, into one :class:`Checkpoint` in torch's terms; ``write`` stores
it as a commit; ``importer`` orders the sources and makes the import incremental and safe.

Rejected alternative: replaying checkpoints through a live ``dstt.session`` — it needs the
model's code and a matching optimizer for every source, and cannot hold what a live process
would not (another world size's ZeRO partitions, log history).
"""

from __future__ import annotations

from .checkpoint import Checkpoint, NamedOptimizer
from .importer import Imported, ImportReport, Skipped, import_checkpoints
from .sources import FORMATS, Source, find_sources

__all__ = [
    "FORMATS",
    "Checkpoint",
    "ImportReport",
    "Imported",
    "NamedOptimizer",
    "Skipped",
    "Source",
    "find_sources",
    "import_checkpoints",
]
