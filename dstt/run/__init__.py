"""The user-facing front of a committed run: ``dstt.open(path)`` → ``Run`` → ``run.at(step)``
→ ``Snapshot``. Modules: ``run`` (``open_run``, ``find_run_root``, ``Run``: timelines,
steps, metrics, trajectories, diffs, replay, rollback, gc, verify); ``snapshot``
(``Snapshot``: one step's lazy tensors, objects, export, the way back to torch);
``metrics`` (``Metrics``: the index's metric columns in numpy, a ``Dataset`` when asked);
``diagnose`` (``RunDiagnostics``: spike causes, attribution, non-finite values, divergence);
``explain`` (``explain_spike``, ``Explanation``: spike mechanisms checked and ranked).

Everything here reads through ``dstt.store`` and ``dstt.inspect``; nothing below imports it.
Only what lists a run is imported with it: the views import their builders when first used,
so ``dstt ls`` starts fast. Rejected alternative: importing xarray and torch with the run,
which every ``dstt ls`` would pay for.
"""

from __future__ import annotations

from .diagnose import Diagnosis, RunDiagnostics
from .metrics import Metrics
from .run import Run, find_run_root, open_run
from .snapshot import Snapshot

__all__ = ["Diagnosis", "Metrics", "Run", "RunDiagnostics", "Snapshot", "find_run_root", "open_run"]
