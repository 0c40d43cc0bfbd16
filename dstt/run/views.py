"""A run's views over many steps: one tensor's ``trajectory`` (light steps rebuilt beside the
stored ones), the write-time ``summaries`` and the ``diff`` of two steps, each a lazy xarray
object built by :mod:`dstt.inspect` (imported when a view is first asked for).

:class:`dstt.Run`'s ``trajectory``, ``summaries`` and ``diff`` call these functions with the
run, which they read through ``ViewedRun`` (the protocol below): this module imports nothing
of ``run.py``. Rejected alternative: the views as methods of ``Run`` — the run's file held the
timelines, the rebuilds, the views and the changes at once (1,066 lines).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from dstt.errors import StepNotFoundError
from dstt.inspect.catalog import Catalog

from .lines import as_steps, step_bounds

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import xarray as xr

    from dstt.inspect.readers import ReaderPool
    from dstt.store._internal import CommitHeader, Reader

    from .lines import Lines, Steps
    from .rebuilt import Rebuilder
    from .snapshot import Snapshot

__all__ = ["ViewedRun", "diff", "summaries", "trajectory"]


class ViewedRun(Protocol):
    """What the views read a run through (``dstt.Run``): its readers, timelines, rebuilds
    and the names of a commit."""

    _readers: ReaderPool
    _lines: Lines
    _rebuilder: Rebuilder

    @property
    def reader(self) -> Reader: ...

    def catalog(self, header: CommitHeader) -> Catalog: ...

    def at(self, step: int | None = None, timeline: str | None = None) -> Snapshot: ...


def trajectory(
    run: ViewedRun,
    name: str,
    steps: Steps,
    *,
    timeline: str | None,
    state: str | None,
    chunks: Any,
    progress: Callable[[int, int], None] | None,
) -> xr.DataArray:
    """One tensor over steps (``Run.trajectory``). Light steps among them, with replay
    objects: rebuilt (one pass per gap), their values read into memory, and the stored
    steps' (lazy) beside them."""
    from dstt.inspect.views import trajectory_dataarray

    # the run's own parts (ViewedRun)
    lines, rebuilder, readers = run._lines, run._rebuilder, run._readers  # noqa: SLF001
    light = lines.light_in(steps, timeline) if rebuilder.active else []
    if steps is None or isinstance(steps, slice):
        headers = lines.select(steps, timeline)
    else:  # the stored steps named; the light ones are rebuilt
        headers = lines.select(sorted({int(s) for s in as_steps(steps)} - set(light)), timeline)
    if not headers and not light:
        raise StepNotFoundError(
            f"no committed steps match {steps!r} on timeline {timeline or lines.timeline!r}"
        )
    snaps = rebuilder.rebuilt(light, lines, timeline=timeline, progress=progress) if light else {}
    newest_step = max(light[-1] if light else -1, headers[-1].step if headers else -1)
    if headers and headers[-1].step == newest_step:
        newest = run.catalog(headers[-1])
    else:
        newest = snaps[newest_step].catalog
    path = newest.resolve(name, state, where=f"at step {newest_step}, the newest selected step")
    if not light:
        return trajectory_dataarray(readers, headers, path, newest, chunks=chunks)
    import xarray as xr

    parts = (
        [trajectory_dataarray(readers, headers, path, run.catalog(headers[-1]))] if headers else []
    )
    for k in light:
        snap = snaps[k]
        one = trajectory_dataarray(snap._readers, [snap.header], path, snap.catalog).load()  # noqa: SLF001 - the run's own snapshot
        parts.append(
            one.assign_coords(slot=("step", [-1]), timeline=("step", [timeline or lines.timeline]))
        )
    out = xr.concat(parts, dim="step", combine_attrs="override").sortby("step")
    out.attrs["rebuilt_steps"] = list(light)
    return out


def summaries(
    run: ViewedRun,
    steps: Steps,
    *,
    timeline: str | None,
    progress: Callable[[int, int], None] | None,
    chunks: Any,
) -> xr.Dataset:
    """Write-time per-tensor statistics over steps (``Run.summaries``)."""
    from dstt.inspect.indexed import summaries_from_rows

    lines = run._lines  # noqa: SLF001 - the run's own parts (ViewedRun)
    name = timeline or lines.timeline
    if steps is None or isinstance(steps, slice):  # pruned steps' summaries stay too
        line = lines.lineage(name)
        if isinstance(steps, slice):
            lo, hi = step_bounds(steps)
            line = [h for h in line if lo <= h.step <= hi][:: steps.step or 1]
    else:
        by_step = {h.step: h for h in lines.lineage(name)}
        line = [by_step.get(int(st)) or lines.header(int(st), name) for st in as_steps(steps)]
    ds = summaries_from_rows(run.reader.scalar_rows(line))
    if progress:
        progress(len(line), len(line))
    return ds if chunks is None else ds.chunk(chunks)


def diff(
    run: ViewedRun,
    a: int,
    b: int,
    *,
    timeline: str | None,
    timeline_b: str | None,
    selector: str | None,
    paths: Iterable[str] | None,
    optim: bool,
    progress: Callable[[int], None] | None,
) -> xr.Dataset:
    """Per-tensor change from step ``a`` to step ``b`` (``Run.diff``)."""
    from dstt.inspect.compare import diff_commits

    ha, ra, ca = _side(run, a, timeline)
    hb, rb, cb = _side(run, b, timeline_b or timeline)
    paths = None if paths is None else list(paths)
    if paths is None and not optim:
        paths = sorted(set(ca.model_paths) | set(cb.model_paths))
    if selector is not None:
        both = sorted(set(ca.pool) | set(cb.pool)) if paths is None else paths
        paths = Catalog(
            ca.table | cb.table,
            where=f"at steps {a} or {b}"
            + ("" if optim else " (optimizer states excluded: optim=True adds them)"),
            listing=f"run.at({b}).names(optim=True)",
        ).select(selector, paths=both)[0]
    if paths is not None:  # a tied name is its target's tensor
        paths = list(dict.fromkeys(cb.tied.get(p, ca.tied.get(p, p)) for p in paths))
    reader = run.reader if ra is rb else _Both({id(ha): ra, id(hb): rb})
    return diff_commits(reader, ha, hb, paths, progress=progress)  # type: ignore[arg-type]


def _side(run: ViewedRun, step: int, timeline: str | None) -> tuple[Any, Any, Catalog]:
    """(header, reader, catalog) of one side of a diff: a stored step's, or a light
    step's derived commit when the run has replay objects or one written (``dstt rebuild``)."""
    snap = run.at(step, timeline)
    return snap.header, snap._reader, snap.catalog  # noqa: SLF001 - the run's own snapshot


class _Both:
    """The reader a diff reads two commits through when one is a rebuilt step's (derived,
    in a repository of its own): each header's own reader."""

    def __init__(self, by_header: dict[int, Reader]) -> None:
        self._by = by_header

    def arrays(self, header: CommitHeader) -> dict[str, Any]:
        return self._by[id(header)].arrays(header)

    def read_chunk(self, header: CommitHeader, path: str, index: int) -> memoryview:
        return self._by[id(header)].read_chunk(header, path, index)
