"""Callbacks for training frameworks: the Hugging Face ``Trainer`` and ``lightning.Trainer``.

Each submodule imports its framework, so nothing here is imported by ``import dstt``: import
``dstt.integrations.transformers`` or ``dstt.integrations.lightning`` where you use it. Both
open a :class:`dstt.Session` when training begins and let its optimizer hooks capture every
step; they add only what the framework's loop needs (its logged values, its step counter, its
data position on resume).

Modules: ``transformers`` the HF ``Trainer`` callback · ``lightning`` the Lightning callback ·
``_common`` what both share (options, unwrapping, metrics) · ``_attribution`` data
attribution and skip sets for loops a framework owns · ``imports`` checkpoints other tools
wrote, as steps of a run (``dstt.import_checkpoints``, ``dstt import``).
"""

from __future__ import annotations

__all__: list[str] = []
