"""Notebook widgets over a run: ``scrubber(run)`` and ``compare(run, a, b)``.

``import dstt.widgets`` needs neither ipywidgets nor matplotlib; creating a widget imports
them and, if they are missing, raises ``ImportError`` with the install hint
(``pip install 'dstt[notebook]'``). The state of each widget is a plain Python model
(:class:`ScrubberModel`, :class:`CompareModel`) that tests can drive and assert on.

- ``model``     ScrubberModel + a small LRU of loaded steps (no widget imports)
- ``views``     matplotlib figures rendered to PNG, artists kept for assertions
- ``scrubber``  the step scrubber widget
- ``replay_panel`` the scrubber's one-click replay of a spike (``scrubber(run, replay=...)``)
- ``compare``   two steps (one or two timelines) side by side
"""

from __future__ import annotations

from .compare import Compare, CompareModel, compare
from .model import LRU, ScrubberModel
from .replay_panel import ReplayPanel
from .scrubber import Scrubber, scrubber

__all__ = [
    "LRU",
    "Compare",
    "CompareModel",
    "ReplayPanel",
    "Scrubber",
    "ScrubberModel",
    "compare",
    "scrubber",
]
