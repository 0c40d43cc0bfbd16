"""The user-facing front of a committed run: ``dstt.open(path)`` → ``Run`` → ``run.at(step)``
→ ``Snapshot``.

* ``run``       — ``open_run`` (``dstt.open``), ``find_run_root``, ``Run``: timelines, steps,
  metrics, summaries, trajectories, diffs, replay, rollback, gc, verify;
* ``snapshot``  — ``Snapshot``: one step's lazy tensors, layer trees, objects, export and the
  way back to torch; it sees its run through ``RunView``;
* ``metrics``   — ``Metrics``: what ``Run.metrics()`` returns, the index's metric columns in
  numpy, an xarray ``Dataset`` built only when asked for;
* ``diagnose``  — ``RunDiagnostics``, held by a ``Run``: spike causes, data attribution,
  first non-finite values, divergence, ``Diagnosis``; it sees its run through ``DiagnosedRun``;
* ``explain``   — ``explain_spike`` (``Run.explain``, ``Spike.explain``) and ``Explanation``:
  each spike mechanism of ``dstt.analysis.mechanisms`` checked on what the run stores (and
  replay recomputes), ranked.

Everything here reads through ``dstt.store`` and ``dstt.inspect``; the plots, the widgets and
the CLI sit above it, and nothing in the store, the engine, the session or ``dstt.inspect``
imports it. Only what lists a run is imported with it (no xarray, no torch): the views import
their builders when first used, so ``dstt ls`` starts fast.
"""

from __future__ import annotations

from .diagnose import Diagnosis, RunDiagnostics
from .metrics import Metrics
from .run import Run, find_run_root, open_run
from .snapshot import Snapshot

__all__ = ["Diagnosis", "Metrics", "Run", "RunDiagnostics", "Snapshot", "find_run_root", "open_run"]
