"""``Run``: the facade of a committed run (``dstt.open(path)``, :mod:`dstt.run.opening`),
composing the parts that each do one job: ``Lines`` (timelines and steps, ``lines.py``),
``Rebuilder`` (light steps rebuilt by replay, ``rebuilt.py``), the views over many steps
(``views.py``), ``RunDiagnostics`` (``diagnose.py``) and ``Metrics`` (``metrics.py``);
``run.at(step)`` gives a ``Snapshot`` (``snapshot.py``). Every byte is read through
:mod:`dstt.store`; what lists a run imports no xarray and no torch (the views import their
builders when first used). The run is read as of ``open`` (or ``run.refresh()``). Rejected
alternatives: mixins split over files (one class over many files); re-reading refs on every
access (steps would change between two cells read together).
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from typing import TYPE_CHECKING, Any

from dstt._lru import LRU
from dstt.errors import ConfigError
from dstt.inspect.catalog import Catalog
from dstt.inspect.html import run_html, run_summary
from dstt.inspect.readers import ReaderPool

from . import views
from .lines import Lines, Steps
from .metrics import Metrics
from .rebuilt import Rebuilder

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterable, Mapping

    import xarray as xr

    from dstt.inspect.diagnose import Divergence, NonFinite
    from dstt.inspect.summaries import Spike
    from dstt.run.explain import Explanation
    from dstt.run.snapshot import Snapshot
    from dstt.store._internal import Batch, CommitHeader, Reader, Repository, SkipSet

    from .diagnose import Diagnosis, RunDiagnostics

__all__ = ["Run"]


class Run:
    """A committed run: its timelines, steps, metrics, summaries and snapshots."""

    def __init__(self, repo: Repository) -> None:
        self.repo = repo
        self.path = repo.storage.location
        self._catalogs: LRU[int, Catalog] = LRU(16)
        #: what rebuilds light steps (``use_replay``), and the steps rebuilt (``rebuilt.py``)
        self._rebuilder = Rebuilder(self)
        self.refresh()

    @functools.cached_property
    def _diagnostics(self) -> RunDiagnostics:
        """Spikes, data attribution, non-finite values, divergence (``diagnose.py``), built
        at first use: its spike rules are nothing ``dstt ls`` or ``run.steps`` needs."""
        from .diagnose import RunDiagnostics

        return RunDiagnostics(self)

    # -- timelines and steps ----------------------------------------------------------------
    def refresh(self) -> Run:
        """Re-read refs and commits (new steps of a live run, after rollback or gc)."""
        # fresh readers, not Reader.refresh(): that keeps cached live headers, which gc may
        # have turned into tombstones since (store bug, reported)
        self._readers = ReaderPool(self.repo.storage)
        #: each timeline's commits, as read once (``lines.py``; a new one at each refresh)
        self._lines = Lines(self._readers.primary, self.path)
        self._catalogs.clear()
        self._rebuilder.clear()
        return self

    @property
    def reader(self) -> Reader:
        """The run's store reader (:class:`dstt.store.Reader`): commits, arrays and objects
        as stored, for code that reads below the inspection API."""
        return self._lines.reader

    @property
    def timeline(self) -> str:
        """The current timeline (the one training resumes)."""
        return self._lines.timeline

    @property
    def timelines(self) -> dict[str, Any]:
        """``{name: RefInfo}`` of every timeline: ``head`` (its newest slot), where it forked
        (``base_timeline``, ``base_step``, ``base_slot``; None for the first one),
        ``skip_data`` and ``created``. A base timeline may since have been renamed (it
        follows) or deleted (the name stays, as history)."""
        return self._lines.reader.timelines

    def commits(self, timeline: str | None = None, *, pruned: bool = False) -> list[Any]:
        """Commit headers of a timeline, oldest first, pruned ones excluded (``pruned=True``:
        included, as tombstones with their metrics; ``h.pruned`` tells them apart)."""
        return self._lines.commits(timeline, pruned=pruned)

    @property
    def steps(self) -> list[int]:
        """Committed steps of the current timeline (pruned steps excluded), ascending."""
        return [h.step for h in self._lines.commits()]

    def light_steps(self, timeline: str | None = None) -> dict[int, str | None]:
        """``{step: loss fingerprint}`` of the light steps of ``timeline`` (``every="auto"``:
        taken, not stored; :mod:`dstt.engine.capture.light`); the fingerprint is the logged loss's
        float64 bits in hex (None: no loss logged). ``run.rebuild(k, ...)`` rebuilds one."""
        return self._lines.light_steps(timeline)

    def select_steps(self, steps: Steps, timeline: str | None = None) -> list[Any]:
        """Headers for ``steps``: None (all), an int, an iterable of steps, or a slice of step
        *values* inclusive at both ends like ``.sel`` (``slice.step`` keeps every k-th).

        Ascending, each step once: ``step`` is the index of every view built from them."""
        return self._lines.select(steps, timeline)

    # -- views ------------------------------------------------------------------------------
    def at(self, step: int | None = None, timeline: str | None = None) -> Snapshot:
        """The snapshot of ``step`` (default: the head) on ``timeline`` (default: current).
        A step that is not on that timeline raises ``StepNotFoundError`` naming the timelines
        that have it."""
        from .derived import rebuildable
        from .snapshot import Snapshot

        if step is not None and rebuildable(self, int(step), timeline or self.timeline):
            return self.rebuilt([int(step)], timeline=timeline)[int(step)]
        return Snapshot(self, self._lines.header(step, timeline), timeline or self.timeline)

    # -- light steps, rebuilt (every="auto"; rebuilt.py) ------------------------------------
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
        self._rebuilder.use(replay, self._lines)
        return self

    def rebuilt(
        self,
        steps: Iterable[int],
        *,
        timeline: str | None = None,
        progress: Callable[[int, int], None] | None = None,
        persist: bool = False,
    ) -> dict[int, Snapshot]:
        """``{step: Snapshot}`` of light ``steps`` rebuilt with the objects of
        :meth:`use_replay` (or ``dstt.open(..., replay=)``): the light steps between two
        stored ones are rebuilt in one pass from the stored step before them.
        ``progress(done, total)`` after each step (a progress bar's update). Each snapshot's
        ``rebuilt`` (a :class:`dstt.inspect.rebuild.Rebuilt`) says from which stored step and
        which losses matched; its commit is derived, held in memory, never in the run's
        history. ``persist=True`` also writes it to the run (:mod:`dstt.run.derived`), where
        a later process's ``at`` reads it without replaying."""
        from .derived import rebuilt_steps

        return rebuilt_steps(self, steps, timeline, progress, persist)

    def catalog(self, header: CommitHeader) -> Catalog:
        """The names of commit ``header`` (:mod:`dstt.inspect.catalog`; cached): its
        tensors by canonical path and its tied names, and how a typed name resolves."""
        listing = f"run.at({header.step}).names(optim=True)"
        return self._catalogs.get_or_make(
            header.slot, lambda: Catalog.of(self.reader, header, listing=listing)
        )

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
        return views.trajectory(
            self,
            name,
            steps,
            timeline=timeline,
            state=state,
            chunks=chunks,
            progress=progress,
        )

    def metrics(self, timeline: str | None = None) -> Metrics:
        """Logged metrics (``s.log(...)``) per step over ``step``: every committed step's,
        and those of the steps ``every=K`` did not checkpoint (``slot`` -1; the next commit
        carries them). Read from the run's index as numpy columns (``m.names``, ``"loss" in
        m``, ``m.column("loss")``, ``m.steps``: no xarray imported); anything else a
        ``Dataset`` has (``m["loss"]``, ``.sel``, ``.to_dataframe()``) answers from
        ``m.to_xarray()``, built once (:mod:`dstt.run.metrics`)."""
        return Metrics(
            self.reader.scalar_rows(self._lines.lineage(timeline or self.timeline), summaries=False)
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
        :func:`dstt.inspect.indexed.summaries_from_rows`); empty if none were written.
        ``chunks`` (e.g. ``{"step": 1000}``): dask-backed variables, to combine with
        ``trajectory(chunks=)`` on a cluster; the statistics themselves are read from the
        run's index here, in one pass (a few bytes per tensor per step)."""
        return views.summaries(self, steps, timeline=timeline, progress=progress, chunks=chunks)

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
        from dstt.inspect.replay import replay_step
        from dstt.inspect.summaries import Spike

        k = step.first_step if isinstance(step, Spike) else int(step)
        kit = _kit("replay", trainer, module)
        return replay_step(
            self,
            self.reader,
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

        kit = _kit("rebuild", trainer, module)
        return rebuild_step(
            self,
            self.reader,
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
        return views.diff(
            self,
            a,
            b,
            timeline=timeline,
            timeline_b=timeline_b,
            selector=selector,
            paths=paths,
            optim=optim,
            progress=progress,
        )

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
            from dstt.store._internal import write_skips

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
        storage = self.reader.storage
        root = getattr(storage, "root", None)
        url = pathlib.Path(root).resolve().as_uri() if root is not None else storage.location
        return write_references(
            self.reader, self._lines.lineage(name), out, run_url=url.rstrip("/"), timeline=name
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
        return self.reader.arrays(header)

    def __repr__(self) -> str:
        s = self.summary()
        span = f" [{s['first_step']}..{s['last_step']}]" if s["n_steps"] else ""
        return (
            f"<dstt.Run {s['path']!r} timeline={s['timeline']!r} "
            f"steps={s['n_steps']}{span} arrays={s['n_arrays']}>"
        )

    def _repr_html_(self) -> str:
        return run_html(self.summary())


def _kit(verb: str, trainer: Any, module: Any) -> Any:
    """The ``ReplayKit`` of ``trainer`` (None without one) for ``replay``/``rebuild``."""
    if module is not None and trainer is None:
        raise ConfigError(
            f"{verb}'s module= goes with trainer= (a lightning.Trainer and its "
            "LightningModule); for a plain loop pass model= and optimizer="
        )
    from dstt.inspect.replay import replay_kit_for

    return None if trainer is None else replay_kit_for(trainer, module)
