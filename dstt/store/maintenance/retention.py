"""Which steps a run keeps: the retention policy shared by ``dstt gc`` and a live session.

Disk use stays bounded while what matters stays: the recent past densely (``keep_last``), the
old past thinly (``keep_every``), every loss spike's neighbourhood in full (``spike_window``).
``Retention.keep`` is a pure function of one timeline's steps and one metric's values, so gc and
the session share the rule without torch. Spikes are ``run.spikes()``'s (backward-looking, over
every commit's metrics, pruned ones too: a spike found once is found at every later gc); a
window holds the live commits just before and at its first flagged step. Heads, fork points and
kept deltas' bases gc adds itself.

Rejected: a byte budget (what is kept would depend on compression, and a spike window could be
evicted to make room); deleting spike windows once they are old (they are kept to be looked at).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from dstt.analysis import find_spikes

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

__all__ = ["Retention", "find_spikes"]


def _count(name: str, v: int | None, lo: int) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
        raise ValueError(
            f"Retention({name}=...) must be an int >= {lo}"
            f"{' or None' if name in ('keep_last', 'keep_every') else ''}, "
            f"got {v!r}"
        )


@dataclass(frozen=True)
class Retention:
    """Keep the last ``keep_last`` live steps of each timeline, every step divisible by
    ``keep_every``, the steps in ``keep_steps``, and every step within ``spike_window`` steps
    of a spike of ``spike_metric`` (the rule of ``run.spikes()``: robust score above
    ``spike_z`` over the ``spike_baseline`` steps before it, None: the rule's defaults;
    ``spike_window=0``: no spike rule), the commit before each spike and the spike's own
    commit included. Heads, fork points and the bases of kept deltas are always kept. A
    session applies it in the background every ``every_commits`` captured steps
    (``dstt.session(..., retention=...)``); ``dstt gc`` and ``Run.gc(retention=...)`` take
    the same object.

    Light steps (``every="auto"``: taken, not stored, rebuilt by replay) are steps of the
    policy like stored ones (``keep_last`` counts them, a spike at one keeps its window);
    a light step kept keeps what its rebuild reads: the stored step before it (its base)
    and the stored step after it (the commit carrying its record). ``keep_light=False``
    decides on stored steps only; ``GcReport.stranded_light`` then names the light steps
    whose base or record that gc pruned (no longer rebuildable)."""

    keep_last: int | None = None
    keep_every: int | None = None
    spike_window: int = 0
    spike_metric: str = "loss"
    spike_z: float | None = None
    spike_baseline: int | None = None
    keep_steps: tuple[int, ...] = field(default=())
    every_commits: int = 50
    keep_light: bool = True

    def __post_init__(self) -> None:
        if self.keep_last == 0 and not isinstance(self.keep_last, bool):
            raise ValueError(
                "Retention(keep_last=0) would prune every step but the timeline heads; pass "
                "keep_last >= 1 (the last N steps of each timeline), or None for no such rule"
            )
        _count("keep_last", self.keep_last, 1)
        _count("keep_every", self.keep_every, 1)  # 0 would prune all but the heads
        _count("spike_window", self.spike_window, 0)
        _count("spike_baseline", self.spike_baseline, 2)
        _count("every_commits", self.every_commits, 1)
        if not isinstance(self.keep_light, bool):
            raise ValueError(f"Retention(keep_light=...) must be a bool, got {self.keep_light!r}")
        if self.spike_z is not None and (
            not isinstance(self.spike_z, (int, float)) or not self.spike_z > 0
        ):
            raise ValueError(
                f"Retention(spike_z=...) must be a positive number or None, got {self.spike_z!r}"
            )
        object.__setattr__(self, "keep_steps", tuple(int(s) for s in self.keep_steps))

    @property
    def prunes(self) -> bool:
        """Whether the policy prunes anything at all (no rule given: it keeps everything)."""
        return (
            self.keep_last is not None
            or self.keep_every is not None
            or bool(self.keep_steps)
            or self.spike_window > 0
        )

    def spikes(
        self, steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray
    ) -> list[tuple[int, int]]:
        """``(first, last)`` step of the window around each spike of ``values``."""
        return [(lo, hi) for lo, hi, _ in self._found(steps, values)]

    def _found(
        self, steps: Sequence[int] | np.ndarray, values: Sequence[float] | np.ndarray
    ) -> list[tuple[int, int, int]]:
        """``(first, last, start)`` of each spike's window; ``start`` its first flagged step."""
        if self.spike_window <= 0 or len(steps) == 0:
            return []
        w = self.spike_window
        found = find_spikes(
            np.asarray(steps),
            np.asarray(values, dtype=np.float64),
            window=self.spike_baseline,
            z=self.spike_z,
        )
        return [(start - w, peak + w, start) for peak, _, _, _, _, start in found]

    def spike_windows(
        self,
        live: Sequence[int],
        metric_steps: Sequence[int] | np.ndarray = (),
        metric_values: Sequence[float] | np.ndarray = (),
    ) -> list[tuple[int, int]]:
        """``(first, last)`` of each spike's window over ``live`` (one timeline's unpruned
        steps, ascending): ``spikes()``'s window, widened to the live commit before the
        spike's first flagged step and the first live commit at or after it, so a replay of
        the spike finds both (however sparse the commits are)."""
        out = []
        arr = np.asarray(live, dtype=np.int64)
        for lo, hi, start in self._found(metric_steps, metric_values):
            i = int(np.searchsorted(arr, start, side="left"))
            if i > 0:
                lo = min(lo, int(arr[i - 1]))
            if i < len(arr):
                hi = max(hi, int(arr[i]))
            out.append((lo, hi))
        return out

    def keep(
        self,
        live: Sequence[int],
        metric_steps: Sequence[int] | np.ndarray = (),
        metric_values: Sequence[float] | np.ndarray = (),
    ) -> set[int]:
        """The steps of ``live`` (one timeline's unpruned steps, ascending) this policy keeps,
        given the spike metric's values at ``metric_steps`` (every commit, pruned included).
        The last live step (the head) is always kept."""
        if not self.prunes:
            return set(live)
        pinned = set(self.keep_steps)
        keep = {s for s in live if s in pinned}
        if self.keep_last:  # keep_last larger than the timeline keeps all of it
            keep |= set(live[max(0, len(live) - self.keep_last) :])
        if self.keep_every:
            keep |= {s for s in live if s % self.keep_every == 0}
        windows = self.spike_windows(live, metric_steps, metric_values)
        if windows:
            arr = np.asarray(live)
            for lo, hi in windows:
                keep |= set(arr[(arr >= lo) & (arr <= hi)].tolist())
        if live:
            keep.add(live[-1])
        return keep

    def bound(self, steps: int, *, spikes: int = 0, heads: int = 1) -> int:
        """The most live steps a timeline of ``steps`` steps (numbered 1..steps) keeps under
        this policy with ``spikes`` spikes: the tensor-bytes bound is this times the bytes of
        one step (plus the delta bases of kept steps, under ``DeltaPolicy``)."""
        n = heads + len(self.keep_steps) + spikes * (2 * self.spike_window + 1)
        if self.keep_last is not None:
            n += self.keep_last
        if self.keep_every is not None:
            n += math.ceil(steps / self.keep_every)
        return min(n, steps) if self.prunes else steps


def policy(
    retention: Retention | None,
    keep_last: int | None,
    keep_every: int | None,
    keep_steps: Iterable[int],
) -> Retention | None:
    """One policy from gc's arguments: a ``Retention``, or the older keyword form."""
    steps = tuple(keep_steps)
    if retention is not None:
        if keep_last is not None or keep_every is not None or steps:
            raise ValueError(
                "pass either retention=Retention(...) or keep_last/keep_every/keep_steps, not both"
            )
        if not isinstance(retention, Retention):
            raise TypeError(f"retention must be a dstt.Retention, not {retention!r}")
        return retention
    if keep_last is None and keep_every is None and not steps:
        return None
    return Retention(keep_last=keep_last, keep_every=keep_every, keep_steps=steps)
