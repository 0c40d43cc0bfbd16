"""Importing checkpoints people already have: ``dstt.import_checkpoints`` / ``dstt import``.

Hugging Face Trainer folders, ``torch.save`` and safetensors files, DCP folders (any world
size), DeepSpeed tags (ZeRO 0-3, any world size) and Lightning ``.ckpt`` files become committed
steps of a dstt run, one step per checkpoint at its own global step, laid out as the capture
engine lays out a step — so every view, ``export``, ``verify``, ``rollback`` and
``dstt.session(..., resume=True)`` work on an imported run as on a captured one.

Design: one reader per format turns the framework's files, each read by the framework's own
reader (safetensors, ``torch.load(weights_only=True)``, DCP's ``FileSystemReader``,
DeepSpeed's ``zero_to_fp32`` reconstruction), into one :class:`Checkpoint` in torch's terms
(named tensors, a named optimizer state, objects); one writer stores it as a commit
(``write``); ``importer`` orders the sources and makes the import incremental and safe.
Rejected alternative: replaying checkpoints through a live ``dstt.session`` — it needs the
model's code and an optimizer of the right kind for every source, and cannot hold what a
source has but a live process would not (another world size's ZeRO partitions, log history).
"""

from __future__ import annotations

from .checkpoint import Checkpoint, NamedOptimizer
from .importer import Imported, ImportReport, Skipped, import_checkpoints
from .sources import FORMATS, Source, find_sources
from .write import SOURCE_OBJECT

__all__ = [
    "FORMATS",
    "SOURCE_OBJECT",
    "Checkpoint",
    "ImportReport",
    "Imported",
    "NamedOptimizer",
    "Skipped",
    "Source",
    "find_sources",
    "import_checkpoints",
]
