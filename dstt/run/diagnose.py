"""The diagnosis of a run: spike causes, data attribution, first non-finite values, gradual
divergence (the rules are :mod:`dstt.inspect.diagnose`'s), and the batch fingerprints and skip
sets of :mod:`dstt.training.data`.

:class:`dstt.Run` (``run.py``) holds a ``RunDiagnostics`` and its ``spikes``, ``batches``,
``skips``, ``first_nonfinite``, ``divergence`` and ``diagnose`` delegate to it. It reads
through the run's public views (``commits``, ``metrics``, ``summaries``) and its reader's
objects, named by ``DiagnosedRun``, the protocol below; this module imports nothing of
``run.py``. Rejected alternative: a mixin base class of ``Run`` (what it was) — one class split
over two files, the mixin declaring by hand the attributes of the class it is mixed into, and
``diagnose`` reaching ``spikes`` through the subclass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dstt.errors import MetricNotFoundError, StepNotFoundError
from dstt.inspect.diagnose import (
    Divergence,
    NonFinite,
    find_divergence,
    first_nonfinite,
    grown_tensors,
    rank_by_baseline,
    suspect,
)
from dstt.inspect.summaries import Spike
from dstt.store._internal import Batch, SkipSet, read_batches, read_skips

from .lines import step_bounds

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import xarray as xr

    from dstt.store._internal import Reader, Repository

    from .metrics import Metrics

__all__ = ["DiagnosedRun", "Diagnosis", "RunDiagnostics"]

SUSPECT_Z = 4.0  #: an update ratio this far above its baseline makes a spike's suspect "update"
DIVERGENCE_WINDOW = 10  #: diagnose()'s divergence smoothing when the spike window is the default


@dataclass(frozen=True)
class Diagnosis:
    """What :meth:`dstt.Run.diagnose` found: ``spikes``, the first non-finite tensors
    (``nonfinite``, None if none) and sustained rises (``divergence``)."""

    spikes: list[Spike] = field(default_factory=list)
    nonfinite: NonFinite | None = None
    divergence: list[Divergence] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return not (self.spikes or self.nonfinite or self.divergence)

    def __str__(self) -> str:
        lines = [str(s) for s in self.spikes] + [str(d) for d in self.divergence]
        if self.nonfinite is not None:
            lines.append(str(self.nonfinite))
        return "\n".join(lines) or "no spike, no divergence, no non-finite values"


class DiagnosedRun(Protocol):
    """What the diagnosis reads its run through (``dstt.Run``): its timelines, commits,
    metrics and summaries, and its reader's objects."""

    repo: Repository

    @property
    def reader(self) -> Reader: ...

    @property
    def timeline(self) -> str: ...

    def commits(self, timeline: str | None = None) -> list[Any]: ...

    def metrics(self, timeline: str | None = None) -> Metrics: ...

    def summaries(self, steps: Any = None, *, timeline: str | None = None) -> xr.Dataset: ...


class RunDiagnostics:
    """The diagnosis of one run, read through it (``Run``'s methods of the same names
    document what each returns)."""

    def __init__(self, run: DiagnosedRun) -> None:
        self.run = run

    # -- data attribution ---------------------------------------------------------------
    def batches(
        self, steps: slice | Iterable[int] | None = None, *, timeline: str | None = None
    ) -> dict[int, list[Batch]]:
        """Recorded batch fingerprints per step; only the commits carrying ``steps`` are read."""
        run = self.run
        line = run.commits(timeline)
        if steps is None:
            return read_batches(line, run.reader.read_object)
        if isinstance(steps, slice):
            lo, hi = step_bounds(steps)
            found = read_batches(_covering(line, lo, hi), run.reader.read_object)
            return {k: v for k, v in found.items() if lo <= k <= hi}
        want = {int(s) for s in steps}
        if not want:
            return {}
        found = read_batches(_covering(line, min(want), max(want)), run.reader.read_object)
        return {k: v for k, v in found.items() if k in want}

    def skips(self, timeline: str | None = None) -> SkipSet:
        """The samples and batches sessions resumed on ``timeline`` drop."""
        run = self.run
        return read_skips(run.repo.storage, run.reader.timelines, timeline or run.timeline)

    def skip_set(
        self, samples: Iterable[int] | None, steps: Iterable[int] | None, timeline: str | None
    ) -> SkipSet:
        """The skip set of a rollback, checked before anything is written."""
        out = SkipSet(frozenset(int(i) for i in samples or ()))
        if steps is None:
            return out
        wanted = sorted({int(s) for s in steps})
        found = self.batches(wanted, timeline=timeline)
        missing = [k for k in wanted if not found.get(k)]
        if missing:
            raise StepNotFoundError(
                f"no batch was recorded for steps {missing} on timeline "
                f"{timeline or self.run.timeline!r}: only loops that draw from s.data(loader) "
                "record them; pass skip_samples=[...] or skip_data=N instead"
            )
        return SkipSet(out.samples, tuple(b for k in wanted for b in found[k]))

    # -- spikes -------------------------------------------------------------------------
    def spikes(
        self,
        metric: str = "loss",
        *,
        window: int | None = None,
        z: float | None = None,
        around: int = 0,
        top: int = 10,
        baseline: int = 20,
        timeline: str | None = None,
    ) -> list[Spike]:
        """Spikes of a logged metric, each with the committed update that caused it (the
        step rule and the ranking: ``Run.spikes``)."""
        from dstt.inspect.summaries import find_spikes, spike_cause

        name = timeline or self.run.timeline
        # numpy columns of the index: no xarray for a run with no spike; window/z None: the
        # rule's defaults (dstt.analysis.spikes)
        found = find_spikes(*self._logged(metric, name), window=window, z=z)
        if not found:
            return []
        line = self.run.commits(name)
        steps = [h.step for h in line]
        causes = [spike_cause(steps, start) for *_, start in found]
        windows: list[list[int]] = []
        need: set[int] = set()
        for _, cause in causes:
            if cause is None or top <= 0:
                windows.append([])
                continue
            i = steps.index(cause)
            windows.append(steps[max(0, i - around) : i + around + 1])
            need.update(steps[max(0, i - around - baseline) : i + around + 1])
        from dstt.inspect.indexed import summary_columns  # numpy: no xarray for `dstt log`

        sums = summary_columns(self.run.reader.scalar_rows([h for h in line if h.step in need]))
        out = []
        for (s, v, zi, mu, sd, start), (parent, cause), w in zip(
            found, causes, windows, strict=True
        ):
            best: dict[str, tuple[float, float]] = {}
            for st in w:
                for n, score, ratio in rank_by_baseline(sums, st, window=baseline):
                    if np.isfinite(score) and score < 0:
                        continue  # moved less than usual: not abnormal (rank_by_baseline)
                    old = best.get(n)
                    if old is None or _key((score, ratio)) < _key(old):
                        best[n] = (score, ratio)
            ranked = sorted(best.items(), key=lambda kv: _key(kv[1]))[: max(top, 0)]
            verdict = batches = None
            if top > 0:
                cause_rank = rank_by_baseline(sums, cause, window=baseline) if cause else []
                verdict = suspect(cause_rank, SUSPECT_Z if z is None else z)
                lo = (parent + 1) if parent is not None else (cause or start)
                batches = self.batches(slice(min(lo, start), start), timeline=name)
            out.append(
                Spike(
                    s,
                    v,
                    zi,
                    mu,
                    sd,
                    [(n, sc) for n, (sc, _) in ranked],
                    start=start,
                    cause=cause,
                    parent=parent,
                    timeline=name,
                    ratios={n: r for n, (_, r) in ranked},
                    batches=batches or {},
                    suspect=verdict,
                )
            )
        return out

    def _logged(self, metric: str, timeline: str) -> tuple[np.ndarray, np.ndarray]:
        """The steps and float64 values of ``metric`` on ``timeline`` (``MetricNotFoundError``
        naming the logged ones if it never was)."""
        ds = self.run.metrics(timeline)
        if metric not in ds.names:
            raise MetricNotFoundError(
                f"metric {metric!r} was never logged on timeline {timeline!r}; logged: {ds.names}"
            )
        return ds.steps, ds.column(metric).astype(np.float64)

    # -- non-finite values and divergence -------------------------------------------------
    def first_nonfinite(self, timeline: str | None = None) -> NonFinite | None:
        """The first commit whose summaries count a NaN or Inf; None if none."""
        return first_nonfinite(self.run.summaries(timeline=timeline))

    def divergence(
        self,
        metric: str = "loss",
        *,
        window: int = 20,
        rise: float = 1.5,
        sustain: int | None = None,
        timeline: str | None = None,
    ) -> list[Divergence]:
        """Sustained rises of a logged metric, each with the tensors whose norms grew most
        over it."""
        steps, values = self._logged(metric, timeline or self.run.timeline)
        found = find_divergence(steps, values, window=window, rise=rise, sustain=sustain)
        if not found:
            return []
        sums = self.run.summaries(timeline=timeline)
        return [
            Divergence(metric, a, b, c, lo, hi, grown_tensors(sums, a, c)[:10])
            for a, b, c, lo, hi in found
        ]

    def diagnose(
        self,
        metric: str = "loss",
        *,
        window: int | None = None,
        z: float | None = None,
        timeline: str | None = None,
    ) -> Diagnosis:
        """Spikes, the first non-finite tensors and gradual divergence in one report
        (``window``/``z``: the spike rule's; None: its defaults)."""
        spikes = self.spikes(metric, window=window, z=z, timeline=timeline)
        smooth = DIVERGENCE_WINDOW if window is None else max(3, window // 5)
        return Diagnosis(
            spikes,
            self.first_nonfinite(timeline),
            self.divergence(metric, window=smooth, timeline=timeline),
        )


def _key(v: tuple[float, float]) -> tuple[int, float]:
    """Sort key: tensors with a baseline score first (highest first), then by ratio."""
    score, ratio = v
    return (0, -score) if np.isfinite(score) else (1, -ratio)


def _covering(line: Sequence[Any], lo: float, hi: float) -> list[Any]:
    """The commits that carry the steps ``lo..hi``: those in range and the first after."""
    out = [h for h in line if h.step >= lo]
    for i, h in enumerate(out):
        if h.step >= hi:
            return out[: i + 1]
    return out
