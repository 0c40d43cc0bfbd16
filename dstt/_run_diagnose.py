"""The diagnosis half of :class:`dstt.Run`: spike causes, data attribution, first non-finite
values, gradual divergence (the rules are :mod:`dstt.inspect.diagnose`'s), and the batch
fingerprints and skip sets of :mod:`dstt.training.data`.

A mixin rather than more of ``_run.py``: these methods only read through the run's public
views (``commits``, ``metrics``, ``summaries``) and its reader's objects, and keep the file
that holds the run's views and timelines (``_run.py``) small.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import MetricNotFoundError, StepNotFoundError
from .inspect.diagnose import (
    Divergence,
    NonFinite,
    find_divergence,
    first_nonfinite,
    grown_tensors,
    rank_by_baseline,
    suspect,
)
from .inspect.summaries import Spike
from .store import Batch, SkipSet, read_batches, read_skips

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import xarray as xr

    from dstt.store import Reader, Repository  # absolute: this module is about to move

__all__ = ["DiagnoseMixin", "Diagnosis"]


@dataclass(frozen=True)
class Diagnosis:
    """What :meth:`DiagnoseMixin.diagnose` found: ``spikes``, the first non-finite tensors
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


class DiagnoseMixin:
    """Methods :class:`dstt.Run` gets from this module (it provides the attributes used)."""

    repo: Repository
    _reader: Reader

    if TYPE_CHECKING:
        @property
        def timeline(self) -> str: ...
        def commits(self, timeline: str | None = None) -> list[Any]: ...
        def metrics(self, timeline: str | None = None) -> xr.Dataset: ...
        def summaries(self, steps: Any = None, *, timeline: str | None = None,
                      progress: Any = None) -> xr.Dataset: ...

    # -- data attribution ---------------------------------------------------------------
    def batches(self, steps: slice | Iterable[int] | None = None, *,
                timeline: str | None = None) -> dict[int, list[Batch]]:
        """Recorded batch fingerprints per step, ``{step: [Batch, ...]}`` (several with
        gradient accumulation; see :mod:`dstt.training.data`); ``steps`` a slice of step values
        (inclusive) or steps. Only the commits carrying those steps are read."""
        line = self.commits(timeline)
        if steps is None:
            return read_batches(line, self._reader.read_object)
        if isinstance(steps, slice):
            lo = -np.inf if steps.start is None else steps.start
            hi = np.inf if steps.stop is None else steps.stop
            found = read_batches(_covering(line, lo, hi), self._reader.read_object)
            return {k: v for k, v in found.items() if lo <= k <= hi}
        want = {int(s) for s in steps}
        if not want:
            return {}
        found = read_batches(_covering(line, min(want), max(want)), self._reader.read_object)
        return {k: v for k, v in found.items() if k in want}

    def skips(self, timeline: str | None = None) -> SkipSet:
        """The samples and batches sessions resumed on ``timeline`` drop (its rollback's and
        its ancestors'; ``run.rollback(skip_samples=..., skip_batches=...)``)."""
        return read_skips(self.repo.storage, self._reader.timelines, timeline or self.timeline)

    def _skip_set(self, samples: Iterable[int] | None, steps: Iterable[int] | None,
                  timeline: str | None) -> SkipSet:
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
                f"{timeline or self.timeline!r}: only loops that draw from s.data(loader) "
                "record them; pass skip_samples=[...] or skip_data=N instead")
        return SkipSet(out.samples, tuple(b for k in wanted for b in found[k]))

    # -- spikes -------------------------------------------------------------------------
    def _explain(self, found: Sequence[tuple[Any, ...]],
                 causes: Sequence[tuple[int | None, int | None]], *, around: int, top: int,
                 z: float, baseline: int, name: str) -> list[Spike]:
        """Spikes with their tensors ranked by baseline deviation, batches and suspect."""
        line = self.commits(name)
        steps = [h.step for h in line]
        windows: list[list[int]] = []
        need: set[int] = set()
        for _, cause in causes:
            if cause is None or top <= 0:
                windows.append([])
                continue
            i = steps.index(cause)
            windows.append(steps[max(0, i - around):i + around + 1])
            need.update(steps[max(0, i - around - baseline):i + around + 1])
        sums = self.summaries(sorted(need), timeline=name)  # only these commits are read
        out = []
        for (s, v, zi, mu, sd, start), (parent, cause), w in zip(found, causes, windows,
                                                                 strict=True):
            best: dict[str, tuple[float, float]] = {}
            for st in w:
                for n, score, ratio in rank_by_baseline(sums, st, window=baseline):
                    old = best.get(n)
                    if old is None or _after(old, (score, ratio)):
                        best[n] = (score, ratio)
            ranked = sorted(best.items(), key=lambda kv: _key(kv[1]))[:max(top, 0)]
            verdict = batches = None
            if top > 0:
                cause_rank = rank_by_baseline(sums, cause, window=baseline) if cause else []
                verdict = suspect(cause_rank, z)
                lo = (parent + 1) if parent is not None else (cause or start)
                batches = self.batches(slice(min(lo, start), start), timeline=name)
            out.append(Spike(s, v, zi, mu, sd, [(n, sc) for n, (sc, _) in ranked],
                             start=start, cause=cause, parent=parent, timeline=name,
                             ratios={n: r for n, (_, r) in ranked}, batches=batches or {},
                             suspect=verdict))
        return out

    # -- non-finite values and divergence -------------------------------------------------
    def first_nonfinite(self, timeline: str | None = None) -> NonFinite | None:
        """The first commit whose write-time summaries count a NaN or Inf in any tensor,
        with those tensors (:func:`dstt.inspect.diagnose.first_nonfinite`); None if none
        (or the run has no summaries)."""
        return first_nonfinite(self.summaries(timeline=timeline))

    def divergence(self, metric: str = "loss", *, window: int = 20, rise: float = 1.5,
                   sustain: int | None = None, timeline: str | None = None
                   ) -> list[Divergence]:
        """Sustained rises of a logged metric (the rule of :mod:`dstt.inspect.diagnose`:
        trailing median of ``window`` values above ``rise`` x its running minimum for
        ``sustain`` values), each with the tensors whose norms grew most over it."""
        ds = self.metrics(timeline)
        if metric not in ds:
            raise MetricNotFoundError(f"metric {metric!r} was never logged on timeline "
                                      f"{timeline or self.timeline!r}; logged: "
                                      f"{sorted(map(str, ds.data_vars))}")
        found = find_divergence(ds["step"].values, ds[metric].values.astype(np.float64),
                                window=window, rise=rise, sustain=sustain)
        if not found:
            return []
        sums = self.summaries(timeline=timeline)
        return [Divergence(metric, a, b, c, lo, hi, grown_tensors(sums, a, c)[:10])
                for a, b, c, lo, hi in found]

    def diagnose(self, metric: str = "loss", *, window: int = 50, z: float = 4.0,
                 timeline: str | None = None) -> Diagnosis:
        """Spikes (:meth:`spikes`), the first non-finite tensors and gradual divergence of
        ``timeline`` in one report; ``print(run.diagnose())``."""
        spikes = self.spikes(metric, window=window, z=z, timeline=timeline)  # type: ignore[attr-defined]
        return Diagnosis(spikes, self.first_nonfinite(timeline),
                         self.divergence(metric, window=max(3, window // 5), timeline=timeline))


def _key(v: tuple[float, float]) -> tuple[int, float]:
    """Sort key: tensors with a baseline score first (highest first), then by ratio."""
    score, ratio = v
    return (0, -score) if np.isfinite(score) else (1, -ratio)


def _after(old: tuple[float, float], new: tuple[float, float]) -> bool:
    return _key(new) < _key(old)


def _covering(line: Sequence[Any], lo: float, hi: float) -> list[Any]:
    """The commits that carry the steps ``lo..hi``: those in range and the first after."""
    out = [h for h in line if h.step >= lo]
    for i, h in enumerate(out):
        if h.step >= hi:
            return out[:i + 1]
    return out
