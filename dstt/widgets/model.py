"""The scrubber's state as a plain Python object: what is selected, and the numbers it shows.

:class:`ScrubberModel` holds the selection (timeline, step, tensor, reference step, view mode)
and computes what the views draw (metric curve, spikes, the tensor's values, per-tensor change),
caching loaded steps in a small LRU. It imports neither ipywidgets nor matplotlib: tests drive
it directly and assert on it, and the widget layer (:mod:`dstt.widgets.scrubber`) only mirrors
it. Observers registered with :meth:`ScrubberModel.observe` are called synchronously with the
set of fields that changed.

Rejected alternative: keeping the state in the widgets' traitlets — then every test needs
ipywidgets, and logic such as "snap the step when the timeline changes" ends up split across
observer callbacks whose firing order is the widget library's business.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from dstt._lru import LRU
from dstt.errors import MetricNotFoundError, StepNotFoundError, TensorNotFoundError, TimelineError
from dstt.plots.draw import image_strides
from dstt.plots.series import no_change, ranked, step_change
from dstt.schema import user_name

if TYPE_CHECKING:
    import xarray as xr

    from dstt.inspect.summaries import Spike
    from dstt.run.run import Run
    from dstt.run.snapshot import Snapshot

__all__ = ["LRU", "Mode", "ScrubberModel"]

Mode = Literal["values", "change"]
Observer = Callable[[set[str]], None]
#: the selection fields whose change :meth:`ScrubberModel._changes` detects
_FIELDS = ("steps", "step", "reference", "mode", "tensor")


def subsample(da: Any, max_side: int) -> np.ndarray:  # noqa: ANN401 - a DataArray
    """The values of ``da`` (a lazy DataArray) every :func:`image_strides` rows and columns
    of its matrix view; only the rows (and a matrix's columns) kept are read."""
    rs, cs = image_strides(da.shape, max_side) if da.ndim >= 2 else (1, 1)
    if da.ndim >= 1 and rs > 1:
        da = da.isel({da.dims[0]: slice(None, None, rs)})
    if da.ndim == 2 and cs > 1:
        da = da.isel({da.dims[1]: slice(None, None, cs)})
    v = np.asarray(da.values)
    if v.ndim > 2 and cs > 1:
        v = v.reshape(v.shape[0], -1)[:, ::cs]
    return v


def default_metric(metrics: xr.Dataset) -> str | None:
    """``loss`` if logged, else the first numeric metric, else None."""
    numeric = [str(k) for k, v in metrics.data_vars.items() if v.dtype.kind in "fiub"]
    return "loss" if "loss" in numeric else (numeric[0] if numeric else None)


class ScrubberModel:
    """Selection and derived data of a scrubber over one run (see the module docstring).

    ``reference`` None means "the previous committed step"; an int pins a step. ``mode``
    ``"values"`` shows the tensor, ``"change"`` its difference from the reference.
    """

    def __init__(
        self,
        run: Run,
        *,
        timeline: str | None = None,
        step: int | None = None,
        tensor: str | None = None,
        metric: str | None = None,
        reference: int | None = None,
        mode: Mode = "values",
        cache_size: int = 16,
        spike_window: int | None = None,
        spike_z: float | None = None,
        max_side: int = 256,
        prefetch: int = 1,
    ) -> None:
        self.run = run
        #: committed steps on each side of the current one loaded in the background
        self.prefetch = max(0, int(prefetch))
        #: the last error of a background load (never raised: the step loads again in front)
        self.prefetch_error: BaseException | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None
        self.spike_window, self.spike_z, self.max_side = spike_window, spike_z, max_side
        self.cache: LRU[tuple[Any, ...], Any] = LRU(cache_size)
        self._observers: list[Observer] = []
        self._metric_arg = metric
        self._timeline = timeline or run.timeline
        self._load_timeline()
        self._step = self._snap(step if step is not None else self.steps[-1])
        self._reference = None if reference is None else self._committed(reference, "reference")
        self._mode: Mode = "values"
        self.mode = mode  # validates; no observer yet to notify
        self._tensor = (
            self._param(tensor) if tensor is not None else self._default_tensor(self.tensors)
        )

    # -- observers --------------------------------------------------------------------------
    def observe(self, fn: Observer) -> Observer:
        """Call ``fn(changed_fields)`` after every change; returns ``fn``."""
        self._observers.append(fn)
        return fn

    def _notify(self, changed: set[str]) -> None:
        if changed:
            for fn in list(self._observers):
                fn(changed)

    @contextmanager
    def _changes(self, *said: str) -> Iterator[None]:
        """Notify, after the block, the fields it changed and ``said`` whatever the values."""
        before = {f: getattr(self, f) for f in _FIELDS}
        yield
        self._notify({*said, *(f for f in _FIELDS if getattr(self, f) != before[f])})

    # -- timeline -------------------------------------------------------------------------
    def _load_timeline(self) -> None:
        from dstt.run.derived import written_bases

        steps = [h.step for h in self.run.commits(self._timeline)]
        if not steps:
            raise ValueError(f"timeline {self._timeline!r} has no committed steps")
        light = self.run.light_steps(self._timeline)
        #: ``{step: base}``: light steps (``every="auto"``) with a rebuilt copy written
        #: (``dstt rebuild``): shown among the steps, read without replaying
        self.rebuilt: dict[int, int] = (
            {k: b for k, b in written_bases(self.run, self._timeline).items() if k in light}
            if light
            else {}
        )
        #: light steps with none written: not stored, not among the steps
        self.light: list[int] = sorted(k for k in light if k not in self.rebuilt)
        self.steps: list[int] = sorted({*steps, *self.rebuilt})
        self.metrics: xr.Dataset = self.run.metrics(self._timeline).to_xarray()
        self.metric = self._metric_arg or default_metric(self.metrics)
        if self.metric is not None and self.metric not in self.metrics:
            raise MetricNotFoundError(
                f"metric {self.metric!r} was never logged on {self._timeline!r}"
            )
        self.spikes = (
            []
            if self.metric is None
            else self.run.spikes(
                self.metric, window=self.spike_window, z=self.spike_z, timeline=self._timeline
            )
        )

    @property
    def timelines(self) -> list[str]:
        """Every timeline of the run, the run's current one first."""
        return sorted(self.run.timelines, key=lambda t: (t != self.run.timeline, t))

    @property
    def timeline(self) -> str:
        return self._timeline

    @timeline.setter
    def timeline(self, name: str) -> None:
        if name == self._timeline:
            return
        if name not in self.run.timelines:
            raise TimelineError(f"no timeline {name!r}; have {self.timelines}")
        self._timeline = name
        self._reload("steps")

    def refresh(self) -> None:
        """Re-read the run (new steps of a live run, after a rollback or gc elsewhere)."""
        self.run.refresh()
        self.cache.clear()
        if self._timeline not in self.run.timelines:
            self._timeline = self.run.timeline
        self._reload()

    def _reload(self, *said: str) -> None:
        """Re-read the timeline, keep the step, reference and tensor where they still exist,
        and notify what changed (``said``: changed whatever the values)."""
        with self._changes("timeline", "metrics", "spikes", *said):
            self._load_timeline()
            self._step = self._snap(self._step)
            if self._reference is not None and self._reference not in self.steps:
                self._reference = None
            self._keep_tensor()

    def _snap(self, step: int) -> int:
        """The latest step <= ``step`` on this timeline (the first step if none)."""
        i = int(np.searchsorted(self.steps, step, side="right")) - 1
        return self.steps[max(i, 0)]

    # -- step -------------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        step = self._committed(step)
        if step != self._step:
            with self._changes():
                self._step = step
                self._keep_tensor()
            self._prefetch_neighbours()

    def _committed(self, step: int, what: str = "step") -> int:
        """``step`` as an int; ``StepNotFoundError`` if it is not among :attr:`steps`."""
        step = int(step)
        if step not in self.steps:
            raise StepNotFoundError(
                f"{what} {step} is not committed on timeline {self._timeline!r}"
            )
        return step

    # -- prefetch ---------------------------------------------------------------------------
    def _prefetch_neighbours(self) -> None:
        """Load the next and previous :attr:`prefetch` steps' data (snapshot, the shown
        tensor, the change) into the cache in one background thread, nearest first; a request
        that is still queued when the step moves again is dropped."""
        if self.prefetch == 0:
            return
        i = self.index
        near = [
            self.steps[j]
            for d in range(1, self.prefetch + 1)
            for j in (i + d, i - d)
            if 0 <= j < len(self.steps)
        ]
        if not near:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="dstt-scrubber-prefetch")
        if self._pending is not None:
            self._pending.cancel()  # not started yet: the user has moved on
        want = (self._timeline, self._tensor, self._reference, near)
        self._pending = self._pool.submit(self._warm, *want)

    def _warm(self, timeline: str, tensor: str, reference: int | None, steps: list[int]) -> None:
        for s in steps:
            try:
                self._warm_step(timeline, tensor, reference, s)
            except Exception as e:  # a prefetch never breaks the widget: kept, not raised
                self.prefetch_error = e

    def _warm_step(self, timeline: str, tensor: str, reference: int | None, step: int) -> None:
        self.snapshot(step, timeline)
        self._values(timeline, step, tensor)
        self.cache.get_or_make(
            ("change", timeline, step, reference),
            lambda: step_change(self.run, step, reference, timeline=timeline),
        )

    def wait_prefetch(self, timeout: float | None = None) -> None:
        """Wait for the background load in flight (tests; a notebook never needs to)."""
        pending = self._pending
        if pending is not None and not pending.cancelled():
            wait([pending], timeout=timeout)

    def close(self) -> None:
        """Stop the prefetch thread (queued loads are dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    @property
    def index(self) -> int:
        """Position of the current step in :attr:`steps`."""
        return self.steps.index(self._step)

    @index.setter
    def index(self, i: int) -> None:
        self.step = self.steps[i]

    def next(self, n: int = 1) -> None:
        """Move ``n`` committed steps forward (negative: back), clamped to the ends."""
        self.index = min(max(self.index + n, 0), len(self.steps) - 1)

    # -- tensor, reference, mode ----------------------------------------------------------
    def snapshot(self, step: int | None = None, timeline: str | None = None) -> Snapshot:
        s = self._step if step is None else int(step)
        tl = timeline or self._timeline
        snap: Snapshot = self.cache.get_or_make(("snapshot", tl, s), lambda: self.run.at(s, tl))
        return snap

    @property
    def tensors(self) -> list[str]:
        """Parameter names at the current step, tied names included (buffers and optimizer
        states left out)."""
        return [
            user_name(p) for p in self.snapshot().catalog.model_paths if p.startswith("params/")
        ]

    def _param(self, name: str) -> str:
        """The full name of the parameter ``name`` means at the current step: exact, short
        (a unique suffix of whole components) or tied; ``TensorNotFoundError`` with the
        closest names (or the candidates of an ambiguous one) otherwise."""
        path = self.snapshot().path(name)
        if not path.startswith("params/"):
            raise TensorNotFoundError(
                f"{name!r} is not a parameter (the scrubber shows "
                f"parameters); parameters: {self.tensors[:8]}"
            )
        return user_name(path)

    def _shape(self, name: str) -> tuple[int, ...]:
        snap = self.snapshot()
        return tuple(snap.catalog.table[snap.path(name)].shape)

    def _default_tensor(self, names: list[str]) -> str:
        """The first matrix-shaped parameter (the heatmap is the interesting view), else the
        first parameter."""
        mats = [n for n in names if len(self._shape(n)) >= 2]
        return (mats or names or [""])[0]

    def _keep_tensor(self) -> None:
        """The default tensor where the selected one is no parameter at the current step."""
        names = self.tensors
        if self._tensor not in names:
            self._tensor = self._default_tensor(names)

    @property
    def tensor(self) -> str:
        return self._tensor

    @tensor.setter
    def tensor(self, name: str) -> None:
        name = self._param(name)
        if name != self._tensor:
            self._tensor = name
            self._notify({"tensor"})

    @property
    def reference(self) -> int | None:
        """The pinned reference step, or None for "the previous committed step"."""
        return self._reference

    @reference.setter
    def reference(self, step: int | None) -> None:
        step = None if step is None else self._committed(step)
        if step != self._reference:
            self._reference = step
            self._notify({"reference"})

    @property
    def reference_step(self) -> int | None:
        """The step compared against now (None at the first step with no pinned reference)."""
        if self._reference is not None:
            return self._reference
        i = self.index
        return self.steps[i - 1] if i > 0 else None

    @property
    def mode(self) -> Mode:
        return self._mode

    @mode.setter
    def mode(self, mode: Mode) -> None:
        if mode not in ("values", "change"):
            raise ValueError(f"mode must be 'values' or 'change', not {mode!r}")
        if mode != self._mode:
            self._mode = mode
            self._notify({"mode"})

    # -- derived data ---------------------------------------------------------------------
    @property
    def metric_value(self) -> float | None:
        if self.metric is None:
            return None
        v = self.metrics[self.metric].sel(step=self._step).item()
        return float(v) if np.isfinite(v) else None

    @property
    def spike(self) -> Spike | None:
        """The detected spike at the current step, if any."""
        return next((s for s in self.spikes if s.step == self._step), None)

    @property
    def caused(self) -> Spike | None:
        """The detected spike whose cause is the current step's update, if any."""
        return next((s for s in self.spikes if s.cause == self._step), None)

    def open_spike(self, spike: Any) -> None:  # noqa: ANN401 - a Spike or a loss step
        """Show the update that caused ``spike`` (a :class:`~dstt.inspect.summaries.Spike`,
        or the loss step of one of :attr:`spikes`): its timeline, step = ``spike.cause``,
        reference = the previous commit (``spike.parent``), mode ``change``, and the tensor
        that moved most in that update.

        Step rule (:meth:`dstt.Run.spikes`): the loss filed under step *k* was computed on the
        weights of step *k - 1*, so the update to look at is *(k - 2) -> (k - 1)*, not the
        update into *k* (the optimizer's reaction to the bad loss).
        """
        if not hasattr(spike, "cause"):
            found = next((s for s in self.spikes if s.step == int(spike)), None)
            if found is None:
                raise StepNotFoundError(
                    f"no spike at step {spike} on timeline {self._timeline!r}; spikes at "
                    f"{[s.step for s in self.spikes]} (spike_window={self.spike_window}, "
                    f"spike_z={self.spike_z}) — or pass a Spike from run.spikes()"
                )
            spike = found
        if spike.cause is None:
            raise StepNotFoundError(
                f"the spike at step {spike.step} was computed on weights from before the first "
                f"commit: no captured update caused it"
            )
        timeline = getattr(spike, "timeline", None)
        if timeline and timeline != self._timeline:
            self.timeline = timeline
        if spike.cause not in self.steps:
            raise StepNotFoundError(
                f"the cause of the spike at {spike.step}, step "
                f"{spike.cause}, is not committed on {self._timeline!r}"
            )
        with self._changes():
            self._step, self._reference, self._mode = int(spike.cause), None, "change"
            names = self.tensors
            moved = [str(n) for n, _ in spike.tensors if n in names] or [
                n for n in self._ranked_change() if n in names
            ]
            if moved:
                self._tensor = moved[0]
            else:
                self._keep_tensor()

    def _ranked_change(self) -> list[str]:
        """The parameters that changed (finite ratio), most first."""
        ds = self.change()
        ratio = ds["ratio"].values
        return [str(ds["tensor"].values[i]) for i in ranked(ratio) if np.isfinite(ratio[i])]

    def strides(self) -> tuple[int, int]:
        """Subsampling of the tensor's matrix view (1-D tensors are histogrammed whole)."""
        shape = self._shape(self._tensor)
        return image_strides(shape, self.max_side) if len(shape) >= 2 else (1, 1)

    def values(self, step: int | None = None) -> np.ndarray:
        """The current tensor's values at ``step`` (default: current), subsampled by
        :meth:`strides` along its matrix view for big tensors; cached."""
        return self._values(self._timeline, self._step if step is None else int(step), self._tensor)

    def _values(self, timeline: str, step: int, tensor: str) -> np.ndarray:
        values: np.ndarray = self.cache.get_or_make(
            ("values", timeline, step, tensor, self.max_side),
            lambda: subsample(self.snapshot(step, timeline).tensor(tensor), self.max_side),
        )
        return values

    def shown(self) -> tuple[np.ndarray | None, str]:
        """What the tensor view draws now and its title: values, or the change since the
        reference (None when there is no reference to compare with)."""
        name, step = self._tensor, self._step
        rs, cs = self.strides()
        every = f" (every {rs}x{cs})" if rs * cs > 1 else ""
        if self._mode == "values":
            return self.values(), f"{name} @ {step}{every}"
        ref = self.reference_step
        if ref is None:
            return None, f"{name}: no reference step before {step}"
        cur, old = self.values(), self.values(ref)
        if cur.shape != old.shape:
            return None, f"{name}: shape changed between {ref} and {step}"
        return cur.astype(np.float64) - old, f"{name} @ {step} - @ {ref}{every}"

    def change(self) -> xr.Dataset:
        """Per-parameter change of the current step vs the reference (cached); see
        :func:`dstt.plots.series.step_change`."""
        key = ("change", self._timeline, self._step, self._reference)
        ref = self.reference_step
        if self._step in self.rebuilt or ref in self.rebuilt:  # no commit of the run's own
            change: xr.Dataset = self.cache.get_or_make(key, lambda: self._rebuilt_change(ref))
            return change
        change = self.cache.get_or_make(
            key, lambda: step_change(self.run, self._step, self._reference, timeline=self._timeline)
        )
        return change

    def _rebuilt_change(self, ref: int | None) -> xr.Dataset:
        """:meth:`change` where a side is a rebuilt light step: its own derived commit, read
        through ``run.diff`` (``at``), never the run's reader; NaN with no reference."""
        import xarray as xr

        if ref is None:
            return no_change(self.tensors, self._step)
        tl = self._timeline
        params = [p for p in self.snapshot().catalog.model_paths if p.startswith("params/")]
        ds = self.run.diff(ref, self._step, timeline=tl, timeline_b=tl, paths=params)
        out = xr.Dataset({"delta_l2": ds["delta_l2"], "norm": ds["a_l2"], "ratio": ds["ratio"]})
        out.attrs.update(step=self._step, reference=ref, source="tensors", exactness="exact")
        return out

    def label(self) -> str:
        """One line describing the selection (what the widget's label shows); a rebuilt
        light step says so and from which stored step."""
        parts = [
            f"step {self._step}",
            f"timeline {self._timeline}",
            f"{self.index + 1}/{len(self.steps)}",
        ]
        if self._step in self.rebuilt:
            parts.append(f"light, rebuilt from stored step {self.rebuilt[self._step]}")
        if (v := self.metric_value) is not None:
            parts.append(f"{self.metric} {v:.4g}")
        if (sp := self.spike) is not None:
            why = (
                f"caused by the update {sp.parent} → {sp.cause}"
                if sp.update is not None
                else "cause not captured"
            )
            parts.append(f"SPIKE z={sp.zscore:.1f}, {why}")
        if (cause := self.caused) is not None:
            parts.append(f"this update is the cause of the spike at {cause.step}")
        ref = self.reference_step
        pin = "pinned" if self._reference is not None else "previous"
        parts.append(f"reference {ref if ref is not None else '—'} ({pin})")
        return " · ".join(parts)
