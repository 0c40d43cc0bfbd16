"""A run's timelines and their steps, as read once: ``Lines`` keeps each timeline's commits
(cached until ``run.refresh()`` makes a new one), picks the headers a view asks for
(``select``), lists the light steps ``every="auto"`` took without storing, and words the
``StepNotFoundError`` of a step that is elsewhere (another timeline, a light step).

:class:`dstt.Run` holds one and its ``commits``, ``steps``, ``select_steps`` and
``light_steps`` delegate to it. Plain Python over the reader's headers: no numpy, so
``dstt.open(run).steps`` loads none of it here. Rejected alternative: re-reading the
lineage at each call — a view over 10,000 steps would walk the refs and the index each time.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.errors import CorruptRunError, StepNotFoundError

if TYPE_CHECKING:
    from dstt.store._internal import Reader

__all__ = ["Lines", "Steps", "as_steps", "step_bounds"]

Steps = slice | int | Iterable[int] | None


def step_bounds(steps: slice) -> tuple[float, float]:
    """``(lo, hi)`` of a slice of step values, inclusive at both ends (open ends: infinite)."""
    lo = -math.inf if steps.start is None else steps.start
    hi = math.inf if steps.stop is None else steps.stop
    return lo, hi


def as_steps(steps: int | Iterable[int]) -> Iterable[int]:
    """An int (numpy's too) as a one-step list; an iterable of steps as is."""
    return [int(steps)] if isinstance(steps, (int, numbers.Integral)) else steps


class Lines:
    """Each timeline's commits, read once through ``reader``; the run at ``path``."""

    def __init__(self, reader: Reader, path: str) -> None:
        self.reader, self.path = reader, path
        self._lines: dict[str, list[Any]] = {}
        self._all: dict[str, list[Any]] = {}  # pruned commits included
        self._light: dict[str, dict[int, str | None]] = {}  # light steps per timeline

    @property
    def timeline(self) -> str:
        return str(self.reader.current_timeline)

    def commits(self, timeline: str | None = None, *, pruned: bool = False) -> list[Any]:
        """Commit headers of a timeline, oldest first (``pruned``: tombstones included)."""
        name = timeline or self.timeline
        if pruned:
            return list(self.lineage(name))
        if name not in self._lines:
            self._lines[name] = [h for h in self.lineage(name) if not h.pruned]
        return self._lines[name]

    def lineage(self, name: str) -> list[Any]:
        """Every commit of a timeline, pruned ones included (gc keeps their index rows)."""
        if name not in self._all:
            self._all[name] = self.reader.lineage(name)
        return self._all[name]

    def header(self, step: int | None, timeline: str | None) -> Any:
        """The header of ``step`` (None: the head); ``StepNotFoundError`` saying where else
        it is (a light step, another timeline)."""
        if step is None:
            line = self.commits(timeline)
            if not line:
                raise StepNotFoundError(
                    f"timeline {timeline or self.timeline!r} of {self.path} has no commits yet"
                )
            return line[-1]
        try:
            return self.reader.find(int(step), timeline)
        except StepNotFoundError as e:
            hint = self._light_hint(int(step), timeline) or self._elsewhere(int(step), timeline)
            raise StepNotFoundError(f"{e}{hint}") from None

    def _light_hint(self, step: int, timeline: str | None) -> str:
        """The hint a StepNotFoundError for a light step ends with: how to rebuild it."""
        if step not in self.light_steps(timeline):
            return ""
        have = [h.step for h in self.commits(timeline)]
        before = max((s for s in have if s < step), default=None)
        after = min((s for s in have if s > step), default=None)
        return (
            f"; step {step} is a light step (every='auto' did not store it; nearest stored "
            f"steps {before} and {after}): rebuild it with run.rebuild({step}, model=..., "
            f"optimizer=..., dataset=...) — it restores step {before} and replays the "
            "steps after it on their recorded samples — or open the run with those objects, "
            "dstt.open(path, replay=dict(model=..., optimizer=..., dataset=...)), and "
            "run.at, trajectory, diff and load_into rebuild light steps themselves"
        )

    def _elsewhere(self, step: int, timeline: str | None) -> str:
        """Where else ``step`` is committed: the hint a StepNotFoundError ends with."""
        name = timeline or self.timeline
        found = []
        for t in sorted(self.reader.timelines):
            try:
                if t != name and any(h.step == step for h in self.commits(t)):
                    found.append(t)
            except CorruptRunError:  # a damaged timeline is verify's to report, not a hint's
                continue
        if not found:
            return ""
        return (
            f"; step {step} is on timeline{'s' if len(found) > 1 else ''} "
            f"{', '.join(map(repr, found))}: pass timeline={found[0]!r} "
            f"(dstt: --timeline {found[0]})"
        )

    def light_steps(self, timeline: str | None = None) -> dict[int, str | None]:
        """``{step: loss fingerprint}`` of the light steps of ``timeline``."""
        name = timeline or self.timeline
        if name not in self._light:
            stored = {h.step for h in self.commits(name)}
            carrying = self.reader.carrying(self.commits(name), schema.LIGHT_OBJECT)
            found = _read_light(filter(_still_kept, carrying), self.reader.read_object)
            self._light[name] = {k: v for k, v in sorted(found.items()) if k not in stored}
        return self._light[name]

    def select(self, steps: Steps, timeline: str | None = None) -> list[Any]:
        """Headers for ``steps``, ascending, each step once (``Run.select_steps``)."""
        line = self.commits(timeline)
        if steps is None:
            return list(line)
        if isinstance(steps, slice):
            lo, hi = step_bounds(steps)
            picked = [h for h in line if lo <= h.step <= hi]
            return picked[:: steps.step or 1]
        by_step = {h.step: h for h in line}
        wanted = sorted({int(s) for s in as_steps(steps)})
        return [by_step.get(s) or self.header(s, timeline) for s in wanted]

    def light_in(self, steps: Steps, timeline: str | None) -> list[int]:
        """The light steps ``steps`` (as in :meth:`select`) names."""
        light = list(self.light_steps(timeline))
        if steps is None:
            return light
        if isinstance(steps, slice):
            if (steps.step or 1) != 1:  # every k-th stored step: a stride of the stored ones
                return []
            lo, hi = step_bounds(steps)
            return [k for k in light if lo <= k <= hi]
        return sorted({int(s) for s in as_steps(steps)} & set(light))


def _still_kept(header: Any) -> bool:
    """Whether ``header``'s full record still reads: False for a step a gc elsewhere pruned
    after this view was opened (its light records went with it; ``run.refresh()`` sees)."""
    try:
        header.objects  # noqa: B018 - the read is the check
    except StepNotFoundError:
        return False
    return True


def _read_light(line: Iterable[Any], read: Callable[[Any, str], Any]) -> dict[int, str | None]:
    """``{light step: its loss fingerprint or None}`` from the commits ``line`` that carry
    the light record (:mod:`dstt.engine.capture.light` writes it), read with ``read``."""
    out: dict[int, str | None] = {}
    for h in line:
        if schema.LIGHT_OBJECT not in getattr(h, "objects", ()):
            continue
        rec = read(h, schema.LIGHT_OBJECT)
        if not isinstance(rec, Mapping):
            continue
        for k, bits in zip(rec.get("steps", ()), rec.get("loss", ()), strict=False):
            out[int(k)] = bits if isinstance(bits, str) else None
    return out
