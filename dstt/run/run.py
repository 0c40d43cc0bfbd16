"""``Run``: the read-only view over a committed run, plus rollback and gc; ``run.at(step)``
gives a ``Snapshot`` of one step (``snapshot.py``), and its diagnosis methods delegate to
the ``RunDiagnostics`` it holds (``diagnose.py``).

``dstt.open(path)`` returns a :class:`Run`. A run is a set of timelines; the *current* one
(what training resumes) is the default everywhere. Views are lazy xarray objects built by
:mod:`dstt.inspect`; every byte is read through :mod:`dstt.store` (refs -> lineage -> arrays
table -> crc-checked chunks), so aborted, orphaned or pruned data is never shown.

Only what lists a run is imported with this module (no xarray, no torch): the views import
their builders when first used, so ``dstt ls`` starts in a tenth of a second.

The run is read as of ``open`` (or the last :meth:`Run.refresh`): a notebook inspecting a live
training run calls ``run.refresh()`` to see new steps. Rejected alternative: re-reading refs on
every attribute access — steps would change between two cells that the user reads together.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt._lru import LRU
from dstt.errors import ConfigError, CorruptRunError, NotARunError, StepNotFoundError
from dstt.inspect.catalog import Catalog
from dstt.inspect.html import run_html, run_summary
from dstt.inspect.readers import ReaderPool
from dstt.store._internal import Batch, Repository, SkipSet, Storage, fold_rows, is_url, write_skips

from .diagnose import Diagnosis, RunDiagnostics
from .metrics import Metrics

if TYPE_CHECKING:
    import xarray as xr

    from dstt.inspect.diagnose import Divergence, NonFinite
    from dstt.inspect.summaries import Spike
    from dstt.run.explain import Explanation
    from dstt.run.snapshot import Snapshot
    from dstt.store._internal import CommitHeader, Reader

__all__ = ["Run", "find_run_root", "open_run"]

Steps = slice | int | Iterable[int] | None

#: rebuilt light steps kept in memory per run (each a whole state: model and optimizer)
REBUILT_CACHE = 8


def open_run(
    path: str | os.PathLike[str] | Repository | Storage,
    *,
    storage_options: Mapping[str, Any] | None = None,
    replay: Any = None,
) -> Run:
    """Open a run for inspection; ``NotARunError`` if ``path`` is not one. ``path`` may be an
    ``s3://bucket/prefix`` URL (``storage_options``: see ``dstt.store.storage_for``).
    ``replay``: the objects a light step's rebuild needs (``run.rebuild``'s keywords as a
    dict, or a function returning one, ``"FILE.py:FUNCTION"``, or True: the factory the
    run's session named), so ``at``, ``trajectory``, ``diff`` and ``load_into`` reach every
    step of an ``every="auto"`` run (:meth:`Run.use_replay`)."""
    run = _open(path, storage_options)
    return run if replay is None else run.use_replay(replay)


def _open(
    path: str | os.PathLike[str] | Repository | Storage, storage_options: Mapping[str, Any] | None
) -> Run:
    if isinstance(path, Repository):
        return Run(path)
    if not isinstance(path, (str, os.PathLike)) or is_url(path):
        return Run(Repository.open(path, **(storage_options or {})))
    p = os.path.abspath(os.fspath(path))
    if not os.path.exists(p):
        raise NotARunError(f"no run at {path}: no such file or directory")
    if not os.path.isdir(p):
        raise NotARunError(
            f"{path} is a file, not a run directory; pass the run's directory "
            "(the folder holding zarr.json and _dstt/), or a new path for a new run"
        )
    try:
        return Run(Repository.open(path))
    except NotARunError:
        root = find_run_root(os.path.dirname(p))
        if root is None:
            raise
        raise NotARunError(
            f"{path} is a folder inside the run {root}; open the run itself: dstt.open({root!r})"
        ) from None


def find_run_root(path: str | os.PathLike[str]) -> str | None:
    """The run directory holding ``path`` (``path`` itself or its nearest parent that is a
    run, as git finds a repository from any folder inside it); None when there is none."""
    d = os.path.abspath(os.fspath(path))
    while True:
        if os.path.isfile(os.path.join(d, "zarr.json")) and os.path.isdir(os.path.join(d, "_dstt")):
            try:
                Repository.open(d)
                return d
            except NotARunError:
                pass
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent


class Run:
    """A committed run: its timelines, steps, metrics, summaries and snapshots."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.path = repo.storage.location
        self._readers = ReaderPool(repo.storage)
        self._reader = self._readers.primary
        self._lines: dict[str, list[Any]] = {}
        self._all: dict[str, list[Any]] = {}  # pruned commits included
        self._light: dict[str, dict[int, str | None]] = {}  # light steps per timeline
        self._catalogs: LRU[int, Catalog] = LRU(16)
        #: what rebuilds light steps (``use_replay``), and the steps rebuilt (derived commits)
        self._replay: Any = None
        self._replay_made: dict[str, Any] | None = None
        self._rebuilt: LRU[tuple[str, int], Snapshot] = LRU(REBUILT_CACHE)
        #: spikes, data attribution, non-finite values, divergence (``diagnose.py``)
        self._diagnostics = RunDiagnostics(self)

    # -- timelines and steps ----------------------------------------------------------------
    def refresh(self) -> Run:
        """Re-read refs and commits (new steps of a live run, after rollback or gc)."""
        # fresh readers, not Reader.refresh(): that keeps cached live headers, which gc may
        # have turned into tombstones since (store bug, reported)
        self._readers = ReaderPool(self.repo.storage)
        self._reader = self._readers.primary
        self._lines.clear()
        self._all.clear()
        self._light.clear()
        self._catalogs.clear()
        self._rebuilt.clear()
        return self

    @property
    def reader(self) -> Reader:
        """The run's store reader (:class:`dstt.store.Reader`): commits, arrays and objects
        as stored, for code that reads below the inspection API."""
        return self._reader

    @property
    def timeline(self) -> str:
        """The current timeline (the one training resumes)."""
        return str(self._reader.current_timeline)

    @property
    def timelines(self) -> dict[str, Any]:
        """``{name: RefInfo}`` of every timeline: ``head`` (its newest slot), where it forked
        (``base_timeline``, ``base_step``, ``base_slot``; None for the first one),
        ``skip_data`` and ``created``. A base timeline may since have been renamed (it
        follows) or deleted (the name stays, as history)."""
        return self._reader.timelines

    def commits(self, timeline: str | None = None, *, pruned: bool = False) -> list[Any]:
        """Commit headers of a timeline, oldest first, pruned ones excluded (``pruned=True``:
        included, as tombstones with their metrics; ``h.pruned`` tells them apart)."""
        name = timeline or self.timeline
        if pruned:
            return list(self._lineage(name))
        if name not in self._lines:
            self._lines[name] = [h for h in self._lineage(name) if not h.pruned]
        return self._lines[name]

    def _lineage(self, name: str) -> list[Any]:
        """Every commit of a timeline, pruned ones included (gc keeps their index rows)."""
        if name not in self._all:
            self._all[name] = self._reader.lineage(name)
        return self._all[name]

    @property
    def steps(self) -> list[int]:
        """Committed steps of the current timeline (pruned steps excluded), ascending."""
        return [h.step for h in self.commits()]

    def _header(self, step: int | None, timeline: str | None) -> Any:
        if step is None:
            line = self.commits(timeline)
            if not line:
                raise StepNotFoundError(
                    f"timeline {timeline or self.timeline!r} of {self.path} has no commits yet"
                )
            return line[-1]
        try:
            return self._reader.find(int(step), timeline)
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
        for t in sorted(self.timelines):
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
        """``{step: loss fingerprint}`` of the light steps of ``timeline`` (``every="auto"``:
        taken, not stored; :mod:`dstt.engine.light`); the fingerprint is the logged loss's
        float64 bits in hex (None: no loss logged). ``run.rebuild(k, ...)`` rebuilds one."""
        name = timeline or self.timeline
        if name not in self._light:
            from dstt.engine.light import LIGHT_OBJECT, read_light

            stored = {h.step for h in self.commits(name)}
            carrying = self._reader.carrying(self.commits(name), LIGHT_OBJECT)
            found = read_light(carrying, self._reader.read_object)
            self._light[name] = {k: v for k, v in sorted(found.items()) if k not in stored}
        return self._light[name]

    def select_steps(self, steps: Steps, timeline: str | None = None) -> list[Any]:
        """Headers for ``steps``: None (all), an int, an iterable of steps, or a slice of step
        *values* inclusive at both ends like ``.sel`` (``slice.step`` keeps every k-th).

        Ascending, each step once: ``step`` is the index of every view built from them."""
        line = self.commits(timeline)
        if steps is None:
            return list(line)
        if isinstance(steps, slice):
            lo = -np.inf if steps.start is None else steps.start
            hi = np.inf if steps.stop is None else steps.stop
            picked = [h for h in line if lo <= h.step <= hi]
            return picked[:: steps.step or 1]
        if isinstance(steps, (int, np.integer)):
            steps = [int(steps)]
        by_step = {h.step: h for h in line}
        wanted = sorted({int(s) for s in steps})
        return [by_step.get(s) or self._header(s, timeline) for s in wanted]

    # -- views ------------------------------------------------------------------------------
    def at(self, step: int | None = None, timeline: str | None = None) -> Snapshot:
        """The snapshot of ``step`` (default: the head) on ``timeline`` (default: current).
        A step that is not on that timeline raises ``StepNotFoundError`` naming the timelines
        that have it."""
        from .snapshot import Snapshot

        if step is not None and self._replay is not None and self._is_light(int(step), timeline):
            return self.rebuilt([int(step)], timeline=timeline)[int(step)]
        return Snapshot(self, self._header(step, timeline), timeline or self.timeline)

    # -- light steps, rebuilt (every="auto") ------------------------------------------------
    def use_replay(self, replay: Any) -> Run:
        """Rebuild light steps (``every="auto"``) on demand with ``replay``: a dict of
        :meth:`rebuild`'s objects and keywords (``model``, ``optimizer``, ``scheduler``,
        ``dataset``/``collate`` or ``batches``, ``loss_fn``, ``before_step``, ``logged``, or
        ``trainer``/``module``), or a function returning one (called once, at the first
        rebuild): a callable, ``"FILE.py:FUNCTION"`` (imported now), or True for the one the
        run's session named (``dstt.session(..., replay="train.py:make")``). From then on
        ``at(k)`` of a light step restores the stored step before it and replays up to *k*
        into those objects, each loss checked bit for bit (``ReplayError`` where the chain
        breaks), and gives a ``Snapshot`` of the result (``snapshot.rebuilt`` says from
        where); ``trajectory`` and ``diff`` include light steps. The last ``REBUILT_CACHE``
        rebuilt steps stay in memory. Returns the run."""
        from dstt.inspect.rebuild import REPLAY_KEYS, load_factory

        if replay is True:  # the factory the run's sessions named (replay="train.py:make")
            replay = self._named_factory()
        elif isinstance(replay, str):
            replay = load_factory(replay)
        if isinstance(replay, Mapping):
            _check_replay(replay, REPLAY_KEYS)
        elif not callable(replay):
            raise ConfigError(
                f"replay= takes a dict of run.rebuild's objects ({', '.join(REPLAY_KEYS)}) or a "
                f"function returning one, not a {type(replay).__name__}"
            )
        self._replay, self._replay_made = replay, None
        self._rebuilt.clear()
        return self

    def _named_factory(self) -> Any:
        """The factory ``dstt.session(..., replay="FILE.py:FUNCTION")`` recorded in the head
        commit, imported (it runs the file: what ``replay=True`` asks for)."""
        from dstt.inspect.rebuild import load_factory
        from dstt.schema import REPLAY_OBJECT

        line = self.commits()
        rec = (
            self._reader.read_object(line[-1], REPLAY_OBJECT)
            if line and REPLAY_OBJECT in line[-1].objects
            else None
        )
        if not isinstance(rec, Mapping) or not isinstance(rec.get("factory"), str):
            raise ConfigError(
                f"replay=True: the head of {self.path} names no replay factory (a session "
                "records one with dstt.session(..., replay='train.py:make')); pass the "
                "objects instead, replay=dict(model=..., optimizer=..., dataset=...)"
            )
        return load_factory(rec["factory"], rec.get("path"))

    def _replay_kwargs(self) -> dict[str, Any]:
        from dstt.inspect.rebuild import REPLAY_KEYS

        if self._replay_made is None:
            made = self._replay() if callable(self._replay) else self._replay
            if not isinstance(made, Mapping):
                raise ConfigError(
                    f"the replay= function returned a {type(made).__name__}, not a dict of "
                    f"run.rebuild's objects ({', '.join(REPLAY_KEYS)})"
                )
            _check_replay(made, REPLAY_KEYS)
            self._replay_made = dict(made)
        return self._replay_made

    def _is_light(self, step: int, timeline: str | None) -> bool:
        if step in self.light_steps(timeline):
            return all(h.step != step for h in self.commits(timeline))
        return False

    def rebuilt(
        self,
        steps: Iterable[int],
        *,
        timeline: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[int, Snapshot]:
        """``{step: Snapshot}`` of light ``steps`` rebuilt with the objects of
        :meth:`use_replay` (or ``dstt.open(..., replay=)``): the light steps between two
        stored ones are rebuilt in one pass from the stored step before them.
        ``progress(done, total)`` after each step (a progress bar's update). Each snapshot's
        ``rebuilt`` (a :class:`dstt.inspect.rebuild.Rebuilt`) says from which stored step and
        which losses matched; its commit is derived, held in memory, never in the run."""
        from dstt.inspect.rebuild import rebuild_step, rebuilt_commit
        from dstt.inspect.replay import replay_kit_for

        from .snapshot import Snapshot

        name = timeline or self.timeline
        wanted = sorted({int(k) for k in steps})
        out: dict[int, Snapshot] = {}
        todo = []
        for k in wanted:
            got = self._rebuilt.get((name, k))
            if got is None:
                todo.append(k)
            else:
                out[k] = got
        if not todo:
            return out
        if self._replay is None:
            raise ConfigError(
                f"steps {todo} are light steps (every='auto' did not store them) and this run "
                "has nothing to rebuild them with: open it with dstt.open(path, "
                "replay=dict(model=..., optimizer=..., dataset=..., loss_fn=...)) or call "
                "run.use_replay(...)"
            )
        kw = dict(self._replay_kwargs())
        trainer, module = kw.pop("trainer", None), kw.pop("module", None)
        kit = None if trainer is None else replay_kit_for(trainer, module)
        stored = {h.step: h for h in self.commits(name)}
        groups: dict[int, list[int]] = {}
        for k in todo:
            groups.setdefault(max((s for s in stored if s < k), default=-1), []).append(k)
        logged = self._step_metrics(name, todo)
        done = 0

        def keep(i: int, so_far: Any, live: Any) -> None:
            nonlocal done
            if i not in want:
                return
            mine = dataclasses.replace(
                so_far,
                step=i,
                losses={s: v for s, v in so_far.losses.items() if s <= i},
                checked=[s for s in so_far.checked if s <= i],
                unchecked=[s for s in so_far.unchecked if s <= i],
            )
            repo, header = rebuilt_commit(
                live, mine, stored[mine.base], self._reader, logged.get(i)
            )
            snap = Snapshot(_Derived(self, repo, name), header, name)
            snap.rebuilt = mine
            self._rebuilt.put((name, i), snap)
            out[i] = snap
            done += 1
            if progress:
                progress(done, len(todo))

        for _, ks in sorted(groups.items()):
            want = set(ks)
            rebuild_step(self, self._reader, max(ks), kit=kit, timeline=name, on_step=keep, **kw)
        return out

    def _step_metrics(self, timeline: str, steps: list[int]) -> dict[int, dict[str, Any]]:
        """What each of ``steps`` logged (``s.log``), NaN left out."""
        m = self.metrics(timeline)
        where = {int(k): i for i, k in enumerate(m.steps.tolist())}
        out: dict[int, dict[str, Any]] = {}
        for k in steps:
            i = where.get(k)
            if i is None:
                continue
            row = {n: float(m.column(n)[i]) for n in m.names}
            out[k] = {n: v for n, v in row.items() if v == v}
        return out

    def _light_in(self, steps: Steps, timeline: str | None) -> list[int]:
        """The light steps ``steps`` (as in :meth:`select_steps`) names."""
        light = [k for k in self.light_steps(timeline) if self._is_light(k, timeline)]
        if steps is None:
            return light
        if isinstance(steps, slice):
            if (steps.step or 1) != 1:  # every k-th stored step: a stride of the stored ones
                return []
            lo = -np.inf if steps.start is None else steps.start
            hi = np.inf if steps.stop is None else steps.stop
            return [k for k in light if lo <= k <= hi]
        if isinstance(steps, (int, np.integer)):
            steps = [int(steps)]
        mine = set(light)
        return sorted({int(s) for s in steps} & mine)

    def catalog(self, header: CommitHeader) -> Catalog:
        """The names of commit ``header`` (:mod:`dstt.inspect.catalog`; cached): its
        tensors by canonical path and its tied names, and how a typed name resolves."""
        got = self._catalogs.get(header.slot)
        if got is None:
            got = Catalog.of(
                self._reader, header, listing=f"run.at({header.step}).names(optim=True)"
            )
            self._catalogs.put(header.slot, got)
        return got

    def trajectory(
        self,
        name: str,
        steps: Steps = None,
        *,
        timeline: str | None = None,
        state: str | None = None,
        chunks: Any = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> xr.DataArray:
        """Lazy DataArray of one tensor over steps, leading dim ``step`` (index) + ``slot``.

        ``name`` is a dotted torch name or a store path; ``state`` picks an optimizer state
        (``exp_avg``). ``steps`` as in :meth:`select_steps`. Nothing is read until values are;
        then only that tensor's chunks of the selected steps (``.isel``/``.sel`` first!).
        With replay objects (``dstt.open(..., replay=)``), the light steps ``steps`` names
        (all of them for None or a slice without a stride) are rebuilt and included, in one
        pass per gap (``progress(done, total)`` per rebuilt step), their values in memory
        and ``slot`` -1; ``attrs["rebuilt_steps"]`` lists them.
        """
        from dstt.inspect.views import trajectory_dataarray

        light = [] if self._replay is None else self._light_in(steps, timeline)
        if light:
            return self._trajectory_rebuilt(name, steps, light, timeline, state, progress)
        headers = self.select_steps(steps, timeline)
        if not headers:
            raise StepNotFoundError(
                f"no committed steps match {steps!r} on timeline {timeline or self.timeline!r}"
            )
        newest = self.catalog(headers[-1])
        path = newest.resolve(
            name, state, where=f"at step {headers[-1].step}, the newest selected step"
        )
        return trajectory_dataarray(self._readers, headers, path, newest, chunks=chunks)

    def _trajectory_rebuilt(
        self,
        name: str,
        steps: Steps,
        light: list[int],
        timeline: str | None,
        state: str | None,
        progress: Callable[[int, int], None] | None,
    ) -> xr.DataArray:
        """A trajectory whose steps include light ones: those rebuilt (one pass per gap),
        their values read into memory, and the stored steps' (lazy) beside them."""
        import xarray as xr

        from dstt.inspect.views import trajectory_dataarray

        line = timeline or self.timeline
        if isinstance(steps, (int, np.integer)) or (
            steps is not None and not isinstance(steps, slice)
        ):
            wanted = {int(s) for s in ([steps] if isinstance(steps, (int, np.integer)) else steps)}
            headers = self.select_steps(sorted(wanted - set(light)), timeline)
        else:
            headers = self.select_steps(steps, timeline)
        snaps = self.rebuilt(light, timeline=timeline, progress=progress)
        newest_step = max(light[-1], headers[-1].step if headers else -1)
        if headers and headers[-1].step == newest_step:
            newest = self.catalog(headers[-1])
        else:
            newest = snaps[newest_step].catalog
        path = newest.resolve(name, state, where=f"at step {newest_step}, the newest selected step")
        parts = []
        if headers:
            parts.append(
                trajectory_dataarray(self._readers, headers, path, self.catalog(headers[-1]))
            )
        for k in light:
            snap = snaps[k]
            one = trajectory_dataarray(snap._readers, [snap.header], path, snap.catalog).load()  # noqa: SLF001 - the run's own snapshot
            parts.append(one.assign_coords(slot=("step", [-1]), timeline=("step", [line])))
        out = xr.concat(parts, dim="step", combine_attrs="override").sortby("step")
        out.attrs["rebuilt_steps"] = list(light)
        return out

    def metrics(self, timeline: str | None = None) -> Metrics:
        """Logged metrics (``s.log(...)``) per step over ``step``: every committed step's,
        and those of the steps ``every=K`` did not checkpoint (``slot`` -1; the next commit
        carries them). Read from the run's index as numpy columns (``m.names``, ``"loss" in
        m``, ``m.column("loss")``, ``m.steps``: no xarray imported); anything else a
        ``Dataset`` has (``m["loss"]``, ``.sel``, ``.to_dataframe()``) answers from
        ``m.to_xarray()``, built once (:mod:`dstt.run.metrics`)."""
        return Metrics(
            self._reader.scalar_rows(self._lineage(timeline or self.timeline), summaries=False)
        )

    def summaries(
        self,
        steps: Steps = None,
        *,
        timeline: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        chunks: Any = None,
    ) -> xr.Dataset:
        """Write-time per-tensor statistics, dims ``step`` x ``tensor`` (see
        :func:`dstt.inspect.summaries.summaries_dataset`); empty if none were written.
        ``chunks`` (e.g. ``{"step": 1000}``): dask-backed variables, to combine with
        ``trajectory(chunks=)`` on a cluster; the statistics themselves are read from the
        run's index here, in one pass (a few bytes per tensor per step)."""
        from dstt.inspect.indexed import summaries_from_rows

        name = timeline or self.timeline
        if steps is None or isinstance(steps, slice):  # pruned steps' summaries stay too
            line = self._lineage(name)
            if isinstance(steps, slice):
                lo = -np.inf if steps.start is None else steps.start
                hi = np.inf if steps.stop is None else steps.stop
                line = [h for h in line if lo <= h.step <= hi][:: steps.step or 1]
        else:
            by_step = {h.step: h for h in self._lineage(name)}
            wanted = [int(steps)] if isinstance(steps, (int, np.integer)) else list(steps)
            line = [by_step.get(int(st)) or self._header(int(st), name) for st in wanted]
        ds = summaries_from_rows(self._reader.scalar_rows(line))
        if progress:
            progress(len(line), len(line))
        return ds if chunks is None else ds.chunk(chunks)

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
        """Spikes of a logged metric, each with the committed update that caused it.

        Spike rule (:mod:`dstt.analysis.spikes`): a value is flagged when its log is more
        than ``z`` (default 6) robust standard deviations above the median of the 5 values
        before it, the deviation measured over up to ``window`` (default 100) steps before;
        causal, for falling, flat and noisy losses alike. ``Spike.zscore`` is that score.

        Step rule: the metric filed under step *k* was computed on the weights of step
        *k - 1*, so a jump first seen at *k* (``Spike.start``) was caused by the update
        ``parent -> cause`` = ``(k - 2) -> (k - 1)`` (with sparser commits: the committed
        interval holding it). ``Spike.tensors`` are the ``top`` tensors of that update,
        ranked by how far each one's update ratio left its own trailing baseline of
        ``baseline`` commits (robust z-score; ``Spike.ratios`` keeps the ratios; ``around`` >
        0 adds that many commits either side of the cause; empty lists when the run has no
        summaries). ``Spike.batches``, ``suspect``, ``samples`` and ``rollback_to`` name the
        data (:mod:`dstt.inspect.diagnose`); ``top=0`` skips all of that (no reads).
        Open the bad update in
        a widget with ``dstt.widgets.scrubber(run, spike=sp)`` or ``compare(run, spike=sp)``.
        """
        found = self._diagnostics.spikes(
            metric, window=window, z=z, around=around, top=top, baseline=baseline, timeline=timeline
        )
        return [dataclasses.replace(s, explainer=self.explain) for s in found]

    def explain(
        self,
        spike: Spike | int | None = None,
        *,
        replay: Mapping[str, Any] | None = None,
        metric: str = "loss",
        lookback: int = 20,
        heads: int | None = None,
        timeline: str | None = None,
    ) -> Explanation:
        """Why ``spike`` (a ``Spike``, its first step, or None: the largest spike, else the
        first non-finite loss) happened: each mechanism of :mod:`dstt.analysis.mechanisms`
        checked, ranked, with its evidence and what it read (:mod:`dstt.run.explain`).
        ``replay`` (``run.replay``'s keywords as a dict: ``model``, ``optimizer``,
        ``dataset``, ``loss_fn``, ... or ``trainer``) enables the checks that recompute;
        without it they are ``unknown``. ``heads``: attention heads per layer."""
        from .explain import explain_spike

        return explain_spike(
            self,
            spike,
            replay=replay,
            metric=metric,
            lookback=lookback,
            heads=heads,
            timeline=timeline,
        )

    def replay(
        self,
        step: int | Spike,
        model: Any = None,
        optimizer: Any = None,
        *,
        trainer: Any = None,
        module: Any = None,
        before_step: Callable[[], None] | None = None,
        scheduler: Any = None,
        loss_fn: Any = None,
        batches: Any = None,
        dataset: Any = None,
        collate: Any = None,
        activations: Iterable[str] = (),
        per_sample: bool = True,
        per_sample_grads: bool = False,
        timeline: str | None = None,
        trusted: bool = False,
    ) -> Any:
        """Re-execute step ``step`` (or a ``Spike``: its first flagged step) from the commit
        before it, into the given ``model``/``optimizer``/``scheduler`` (built as the run
        built them), on the samples it trained on, and check it against its commit.

        The batches come from the step's recorded sample indices through ``dataset`` (and
        ``collate``, default torch's), or a ``batches`` callable (indices -> batch), or are
        ``batches`` themselves. ``loss_fn(model, batch)`` returns the loss the loop
        back-propagated (gradient-accumulation scaling included; default: the model output's
        ``.loss``); ``before_step()`` runs between the last backward and the optimizer step,
        as the loop did (``torch.nn.utils.clip_grad_norm_``: a clipped step replays bit-exact
        only with it).

        ``trainer=`` (an HF ``transformers.Trainer``, or a ``lightning.Trainer`` with
        ``module=`` the LightningModule) in place of ``model``/``optimizer``: the
        :class:`~dstt.inspect.replay.ReplayKit` registered for its type (``import
        dstt.integrations.transformers`` / ``.lightning``) runs the step as the framework
        does (its collator, loss, clipping); explicit arguments take the place of the kit's.

        Returns a :class:`dstt.inspect.replay.Replay`: ``faithful`` (bit-exact
        against the commit), the gradients (``.grads``, ``.layer(...)``, ``.top()``),
        per-sample losses worst first (``.per_sample``, ``.worst(n)`` for
        ``rollback(..., skip_samples=...)``) and the ``activations`` of the named modules.
        Nothing is written to the run; the live objects end at the replayed step. Only the
        state restored into the given objects is decoded; ``trusted=True`` lets a part of it
        stored with pickle load (it runs code from the run). See docs/replay.md."""
        from dstt.inspect.replay import replay_kit_for, replay_step
        from dstt.inspect.summaries import Spike

        k = (
            (step.start if step.start is not None else step.step)
            if isinstance(step, Spike)
            else int(step)
        )
        if module is not None and trainer is None:
            raise ConfigError(
                "replay's module= goes with trainer= (a lightning.Trainer and its "
                "LightningModule); for a plain loop pass model= and optimizer="
            )
        kit = None if trainer is None else replay_kit_for(trainer, module)
        return replay_step(
            self,
            self._reader,
            k,
            model,
            optimizer,
            kit=kit,
            before_step=before_step,
            scheduler=scheduler,
            loss_fn=loss_fn,
            batches=batches,
            dataset=dataset,
            collate=collate,
            activations=activations,
            per_sample=per_sample,
            per_sample_grads=per_sample_grads,
            timeline=timeline,
            trusted=trusted,
        )

    def rebuild(
        self,
        step: int,
        model: Any = None,
        optimizer: Any = None,
        *,
        trainer: Any = None,
        module: Any = None,
        scheduler: Any = None,
        before_step: Callable[[], None] | None = None,
        loss_fn: Any = None,
        batches: Any = None,
        dataset: Any = None,
        collate: Any = None,
        logged: Callable[[list[float]], float] | None = None,
        check_next: bool = False,
        timeline: str | None = None,
        trusted: bool = False,
    ) -> Any:
        """Bring ``model``/``optimizer``/``scheduler`` (built as the run built them) to step
        ``step``, stored or light (``every="auto"``): restore the nearest stored step before
        it and replay the light steps up to it on their recorded samples (through
        ``dataset``/``collate``, or a ``batches`` callable from indices), checking each
        replayed loss bit for bit against the one the step logged; the first that differs
        raises ``ReplayError`` naming where the chain broke. The scheduler, if given, steps
        after each optimizer step; ``before_step`` and ``loss_fn`` as in :meth:`replay`;
        ``logged(losses)`` gives what the loop logged as ``loss`` from its micro-batches'
        losses (default: the last one, or their sum or mean). ``check_next=True`` first
        replays on to the next stored step and compares every parameter and optimizer-state
        tensor with it bit for bit (twice the replay; ``ReplayError`` if it lands off).
        Returns a :class:`dstt.inspect.rebuild.Rebuilt`; nothing is written to the run.
        See docs/replay.md."""
        from dstt.inspect.rebuild import rebuild_step
        from dstt.inspect.replay import replay_kit_for

        if module is not None and trainer is None:
            raise ConfigError(
                "rebuild's module= goes with trainer= (a lightning.Trainer and its "
                "LightningModule); for a plain loop pass model= and optimizer="
            )
        kit = None if trainer is None else replay_kit_for(trainer, module)
        return rebuild_step(
            self,
            self._reader,
            step,
            model,
            optimizer,
            kit=kit,
            scheduler=scheduler,
            before_step=before_step,
            loss_fn=loss_fn,
            batches=batches,
            dataset=dataset,
            collate=collate,
            logged=logged,
            check_next=check_next,
            timeline=timeline,
            trusted=trusted,
        )

    def _read_summaries(self, h: Any) -> dict[str, Any]:
        """The summaries of one commit; multi-rank runs add one object per other rank."""
        from dstt.inspect.summaries import SUMMARIES_OBJECT, summary_rows

        out = summary_rows(self._reader.read_object(h, SUMMARIES_OBJECT))
        for name in h.objects:
            if name.startswith(f"{SUMMARIES_OBJECT}/"):
                out.update(summary_rows(self._reader.read_object(h, name)))
        return fold_rows(out)  # a sharded tensor's shards: one row

    def diff(
        self,
        a: int,
        b: int,
        *,
        timeline: str | None = None,
        timeline_b: str | None = None,
        selector: str | None = None,
        paths: Iterable[str] | None = None,
        optim: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> xr.Dataset:
        """Per-tensor change from step ``a`` to step ``b`` (see :mod:`dstt.inspect.compare`);
        ``b`` is read from ``timeline_b`` if given (compare two timelines), else ``timeline``.
        The model's tensors only, as ``dstt diff``; ``optim=True`` adds the optimizer states
        (``dstt diff --optim``). ``selector`` restricts to a layer selector
        (:func:`dstt.inspect.naming.select`), ``paths`` to these store array paths
        (``params/...``, ``optim/...``) whatever ``optim`` says."""
        from dstt.inspect.compare import diff_commits

        ha, ra, ca = self._side(a, timeline)
        hb, rb, cb = self._side(b, timeline_b or timeline)
        paths = None if paths is None else list(paths)
        if paths is None and not optim:
            paths = sorted(set(ca.model_paths) | set(cb.model_paths))
        if selector is not None:
            both = sorted(set(ca.pool) | set(cb.pool)) if paths is None else paths
            paths = Catalog(
                ca.table | cb.table,
                where=f"at steps {a} or {b}"
                + ("" if optim else " (optimizer states excluded: optim=True adds them)"),
                listing=(f"run.at({b}).names(optim=True)"),
            ).select(selector, paths=both)[0]
        if paths is not None:  # a tied name is its target's tensor
            paths = list(dict.fromkeys(cb.tied.get(p, ca.tied.get(p, p)) for p in paths))
        reader = self._reader if ra is rb else _Both({id(ha): ra, id(hb): rb})
        return diff_commits(reader, ha, hb, paths, progress=progress)  # type: ignore[arg-type]

    def _side(self, step: int, timeline: str | None) -> tuple[Any, Any, Catalog]:
        """(header, reader, catalog) of one side of a diff: a stored step's, or a light
        step's derived commit when the run has replay objects."""
        if self._replay is not None and self._is_light(int(step), timeline):
            snap = self.at(step, timeline)
            return snap.header, snap._reader, snap.catalog  # noqa: SLF001 - the run's own snapshot
        h = self._header(step, timeline)
        return h, self._reader, self.catalog(h)

    # -- diagnosis (diagnose.py; spikes above) ----------------------------------------------
    def first_nonfinite(self, timeline: str | None = None) -> NonFinite | None:
        """The first commit whose write-time summaries count a NaN or Inf in any tensor,
        with those tensors (:func:`dstt.inspect.diagnose.first_nonfinite`); None if none
        (or the run has no summaries)."""
        return self._diagnostics.first_nonfinite(timeline)

    def divergence(
        self,
        metric: str = "loss",
        *,
        window: int = 20,
        rise: float = 1.5,
        sustain: int | None = None,
        timeline: str | None = None,
    ) -> list[Divergence]:
        """Sustained rises of a logged metric (the rule of :mod:`dstt.inspect.diagnose`:
        trailing median of ``window`` values above ``rise`` x its running minimum for
        ``sustain`` values), each with the tensors whose norms grew most over it."""
        return self._diagnostics.divergence(
            metric, window=window, rise=rise, sustain=sustain, timeline=timeline
        )

    def diagnose(
        self,
        metric: str = "loss",
        *,
        window: int | None = None,
        z: float | None = None,
        timeline: str | None = None,
    ) -> Diagnosis:
        """Spikes (:meth:`spikes`), the first non-finite tensors and gradual divergence of
        ``timeline`` in one report; ``print(run.diagnose())``."""
        return self._diagnostics.diagnose(metric, window=window, z=z, timeline=timeline)

    def batches(
        self, steps: slice | Iterable[int] | None = None, *, timeline: str | None = None
    ) -> dict[int, list[Batch]]:
        """Recorded batch fingerprints per step, ``{step: [Batch, ...]}`` (several with
        gradient accumulation; see :mod:`dstt.training.data`); ``steps`` a slice of step values
        (inclusive) or steps. Only the commits carrying those steps are read."""
        return self._diagnostics.batches(steps, timeline=timeline)

    def skips(self, timeline: str | None = None) -> SkipSet:
        """The samples and batches sessions resumed on ``timeline`` drop (its rollback's and
        its ancestors'; ``run.rollback(skip_samples=..., skip_batches=...)``)."""
        return self._diagnostics.skips(timeline)

    # -- changes --------------------------------------------------------------------------
    def rollback(
        self,
        to: int,
        skip_data: int = 0,
        *,
        timeline: str | None = None,
        name: str | None = None,
        skip_samples: Iterable[int] | None = None,
        skip_batches: Iterable[int] | None = None,
        force: bool = False,
    ) -> str:
        """Start a new timeline at step ``to`` of ``timeline`` (default: current; the old one
        is kept) and make it current; training resumed on this run continues from there,
        skipping ``skip_data`` batches. The new timeline is ``name``, by default
        ``<timeline>-from-<to>``; a name that exists (a second rollback to the same step)
        raises ``TimelineError``. Returns the new timeline's name.

        ``skip_samples`` (sample indices) and ``skip_batches`` (steps of ``timeline`` whose
        recorded batches, ``run.batches()``, are skipped wherever they come again) are
        dropped by every session resumed on the new timeline and those forked from it
        (``run.skips()``; see :mod:`dstt.training.data`).

        A live writer (a training session on this run) holds its lock: ``RunLockedError``
        naming it (host, pid, since when), as for every timeline change here, unless
        ``force=True`` — the session keeps writing its own timeline, and its next resume
        continues the new one."""
        skips = self._diagnostics.skip_set(skip_samples, skip_batches, timeline)
        ref = self.repo.rollback(
            int(to), skip_data=int(skip_data), timeline=timeline, name=name, force=force
        )
        if skips:
            write_skips(self.repo.storage, ref, skips)
        self.refresh()
        return str(ref.name)

    def switch(self, timeline: str, *, force: bool = False) -> None:
        """Make ``timeline`` the current one: the default everywhere here, and what training
        resumed on this run continues (a live writer: see :meth:`rollback`'s ``force``)."""
        self.repo.switch(timeline, force=force)
        self.refresh()

    def rename_timeline(self, old: str, new: str, *, force: bool = False) -> None:
        """Rename a timeline; HEAD and the timelines forked from it follow. Commits keep the
        name they were written under (``Snapshot.header.timeline``: history). Crash-safe: a
        cut leaves both names on the same head, and renaming again finishes it. A live
        writer: see :meth:`rollback`'s ``force``."""
        self.repo.rename_timeline(old, new, force=force)
        self.refresh()

    def delete_timeline(
        self, name: str, *, gc: bool = True, dry_run: bool = False, force: bool = False
    ) -> Any:
        """Delete a timeline other than the current one (``CurrentTimelineError``: switch
        first). With ``gc`` the commits no other timeline reaches and their files are freed;
        its fork ancestry, and what timelines forked from it need, stay. ``dry_run`` only
        reports. Returns a report: ``freed_steps``, ``kept_steps``, ``gc`` (the store's
        :class:`GcReport`, None without ``gc``). A live writer: see :meth:`rollback`'s
        ``force``; forced, the files wait for the next ``gc`` (``report.gc`` is None)."""
        report = self.repo.delete_timeline(name, gc=gc, dry_run=dry_run, force=force)
        self.refresh()
        return report

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_steps: Iterable[int] = (),
        retention: Any = None,
        dry_run: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """Prune steps outside the policy: ``retention=dstt.Retention(...)`` (the object a
        session's ``retention=`` takes: last N, every K-th, spike windows) or the keywords.
        Timeline heads, fork points and kept deltas' bases always stay, and so do the metrics
        and summaries of pruned steps. Returns the store's report (``pruned_steps``,
        ``bytes_freed``, ``spike_windows``, ...)."""
        report = self.repo.gc(
            keep_last=keep_last,
            keep_every=keep_every,
            keep_steps=keep_steps,
            retention=retention,
            dry_run=dry_run,
            progress=progress,
        )
        self.refresh()
        return report

    def virtual(self, out: str | os.PathLike[str], *, timeline: str | None = None) -> Any:
        """Write (or extend) a reference file that presents ``timeline`` as one Zarr store:
        every tensor an array with a leading ``step`` dimension whose chunks point into the
        step files (no copy), metrics along ``step`` at the root. Plain xarray reads it
        through fsspec: ``xr.open_datatree("reference://run", engine="zarr",
        storage_options={"fo": out}, consolidated=False, zarr_format=3)``. A sharded
        tensor is one array whose chunks are the ranks' boxes where one chunk grid holds
        them; steps with delta-encoded chunks and other sharded tensors are left out, listed.
        Returns a :class:`dstt.inspect.virtual.VirtualReport` (docs/virtual.md)."""
        from dstt.inspect.virtual import write_references

        name = timeline or self.timeline
        storage = self._reader.storage
        root = getattr(storage, "root", None)
        url = pathlib.Path(root).resolve().as_uri() if root is not None else storage.location
        return write_references(
            self._reader, self._lineage(name), out, run_url=url.rstrip("/"), timeline=name
        )

    def verify(self, progress: Callable[[int, int], None] | None = None) -> Any:
        """Check every reachable byte; the store's report (``.problems``, ``.ok``)."""
        return self.repo.verify(progress=progress)

    # -- display ----------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Plain-data overview (what ``dstt ls --json`` prints and the HTML repr shows)."""
        return run_summary(self)

    def arrays(self, header: CommitHeader) -> dict[str, Any]:
        """The arrays table of a commit header (cached)."""
        return self._reader.arrays(header)

    def __repr__(self) -> str:
        s = self.summary()
        span = f" [{s['first_step']}..{s['last_step']}]" if s["n_steps"] else ""
        return (
            f"<dstt.Run {s['path']!r} timeline={s['timeline']!r} "
            f"steps={s['n_steps']}{span} arrays={s['n_arrays']}>"
        )

    def _repr_html_(self) -> str:
        return run_html(self.summary())


def _check_replay(made: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    unknown = sorted(set(made) - set(keys))
    if unknown:
        raise ConfigError(f"replay= has unknown keys {unknown}; expected any of {', '.join(keys)}")
    if "trainer" not in made and ("model" not in made or "optimizer" not in made):
        raise ConfigError(
            "replay= needs 'model' and 'optimizer' (built as the training script builds them), "
            "or 'trainer' (with 'module' for Lightning)"
        )


class _Derived:
    """The run a rebuilt step's snapshot reads: the derived commit's own repository (in
    memory) for its tensors and objects, the run itself for its recorded batches."""

    def __init__(self, run: Run, repo: Repository, timeline: str) -> None:
        self._run, self._timeline = run, timeline
        self._readers = ReaderPool(repo.storage)

    @property
    def reader(self) -> Reader:
        return self._readers.primary

    def catalog(self, header: CommitHeader) -> Catalog:
        return Catalog.of(self.reader, header, listing=f"run.at({header.step}).names(optim=True)")

    def batches(
        self, steps: slice | Iterable[int] | None = None, *, timeline: str | None = None
    ) -> dict[int, list[Batch]]:
        return self._run.batches(steps, timeline=timeline or self._timeline)


class _Both:
    """The reader a diff reads two commits through when one is a rebuilt step's (derived,
    in a repository of its own): each header's own reader."""

    def __init__(self, by_header: dict[int, Reader]) -> None:
        self._by = by_header

    def arrays(self, header: CommitHeader) -> dict[str, Any]:
        return self._by[id(header)].arrays(header)

    def read_chunk(self, header: CommitHeader, path: str, index: int) -> memoryview:
        return self._by[id(header)].read_chunk(header, path, index)
