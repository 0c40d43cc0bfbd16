"""The user-facing front of a committed run: ``dstt.open(path)`` → ``Run`` → ``run.at(step)``
→ ``Snapshot``. Modules, one job each: ``opening`` (``open_run``, ``find_run_root``); ``run``
(``Run``, the facade composing the rest); ``lines`` (timelines and steps); ``views``
(trajectories, summaries, diffs); ``rebuilt`` (light steps rebuilt by replay), ``derived``
(rebuilt steps written to the run); ``snapshot``
(one step's lazy tensors, export); ``metrics`` (numpy columns, a ``Dataset`` when asked);
``diagnose`` (spike causes, non-finite values, divergence); ``explain`` (spike mechanisms).

Everything here reads through ``dstt.store`` and ``dstt.inspect``; nothing below imports it.
Only what lists a run is imported with it: the views import their builders when first used,
so ``dstt ls`` starts fast. Rejected alternative: importing xarray and torch with the run,
which every ``dstt ls`` would pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstt._lazy import lazy_names as _lazy_names

from .metrics import Metrics
from .opening import find_run_root, open_run
from .run import Run
from .snapshot import Snapshot

if TYPE_CHECKING:
    from .diagnose import Diagnosis, RunDiagnostics

__all__ = ["Diagnosis", "Metrics", "Run", "RunDiagnostics", "Snapshot", "find_run_root", "open_run"]


#: on first use: their module loads the spike and divergence rules, which opening or listing a
#: run never needs
__getattr__, __dir__ = _lazy_names(
    __name__, {"Diagnosis": "diagnose", "RunDiagnostics": "diagnose"}, __all__
)
