"""Per-step, per-tensor numbers behind the plots and widgets: norms, updates, change vs a step.

Two sources, one shape: the engine's write-time ``summaries`` when every selected commit has
them (a few KB per step, no tensor read), else the tensors, one trajectory per tensor within
``max_bytes``. ``attrs["source"]`` says which, ``attrs["update_exactness"]`` whether updates
are exact or probe estimates; plots put that on their labels. Only ``params/...`` are
included (buffers are often integer masks, optimizer states have their own scale).
``update_ratio`` is ``||w_t - w_prev|| / ||w_t||``; :func:`step_change` against any reference
step is exact, streamed by :mod:`dstt.inspect.compare`.

Rejected alternative: always computing from the tensors — a 1000-step heatmap of a real model
would read the whole run, where the summaries answer it from kilobytes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from dstt.inspect.naming import canonical_path
from dstt.inspect.summaries import (
    ESTIMATE_NOTE,
    SUMMARIES_OBJECT,
    label_updates,
    summary_rows,
    update_exactness,
)
from dstt.schema import user_name

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dstt.run.run import Run
    from dstt.store._internal import CommitHeader

__all__ = ["exactness_label", "param_names", "step_change", "tensor_stats"]

STAT_FIELDS = ("l2", "update_l2", "update_ratio")
DEFAULT_MAX_BYTES = 512 * 1024 * 1024


def _is_param(path: str) -> bool:
    return path.startswith("params/")


def param_names(
    run: Run, step: int | None = None, *, timeline: str | None = None, selector: str | None = None
) -> list[str]:
    """Dotted names of the parameters at ``step`` (default: head); with ``selector``, those it
    picks (tied names included; ``TensorNotFoundError`` with the closest selectors when it
    picks none)."""
    cat = run.at(step, timeline).catalog
    if selector is None:
        return [user_name(p) for p in cat.model_paths if _is_param(p) and p not in cat.tied]
    paths = cat.select(selector, paths=[p for p in cat.model_paths if _is_param(p)])[0]
    return [user_name(p) for p in paths]


def tensor_stats(
    run: Run,
    steps: slice | int | Iterable[int] | None = None,
    *,
    timeline: str | None = None,
    selector: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> xr.Dataset:
    """``l2``, ``update_l2``, ``update_ratio`` and ``update_exact`` over ``(step, tensor)``
    for the parameters.

    ``steps`` as in :meth:`dstt.Run.select_steps`; ``selector`` picks tensors by the layer
    selector rule (a tied name shows its target's numbers; one that picks nothing raises
    ``TensorNotFoundError``). From summaries when every selected commit has them — the
    update numbers are exact or estimates as the summaries' are, and ``attrs`` say so
    (``update_exactness``, the variables' ``note``) — else from the tensors, exactly
    (``MemoryError`` beyond ``max_bytes`` per tensor trajectory: narrow ``steps``).
    """
    headers = run.select_steps(steps, timeline)
    if headers and all(SUMMARIES_OBJECT in h.objects for h in headers):
        ds = run.summaries([h.step for h in headers], timeline=timeline)
        col = {
            canonical_path(str(p)): j
            for j, p in enumerate(ds["store_path"].values)
            if _is_param(str(p))
        }
        chosen, tied = list(col), {}  # tied: a selected tied name -> its stored target
        if selector is not None:
            cat = run.catalog(headers[-1])
            pool = chosen + [a for a, t in cat.tied.items() if t in col and _is_param(a)]
            chosen, tied = cat.select(selector, paths=pool)[0], cat.tied
        out = ds[[*STAT_FIELDS, "update_exact"]].isel(tensor=[col[tied.get(p, p)] for p in chosen])
        out = out.assign_coords(
            tensor=("tensor", np.array([user_name(p) for p in chosen], dtype=object))
        )
        out.attrs["source"] = "summaries"
        return label_updates(out)
    return _stats_from_tensors(run, headers, timeline, selector, max_bytes)


def _stats_from_tensors(
    run: Run, headers: list[Any], timeline: str | None, selector: str | None, max_bytes: int
) -> xr.Dataset:
    steps = [h.step for h in headers]
    names = param_names(run, steps[-1], timeline=timeline, selector=selector) if steps else []
    n = len(steps)
    l2 = np.full((n, len(names)), np.nan)
    upd = np.full((n, len(names)), np.nan)
    for j, name in enumerate(names):
        traj = run.trajectory(name, steps, timeline=timeline)
        nbytes = traj.size * traj.dtype.itemsize
        if nbytes > max_bytes:
            raise MemoryError(
                f"{name}: {n} steps need {nbytes / 2**20:.0f} MiB "
                f"(max_bytes={max_bytes / 2**20:.0f} MiB); select fewer steps"
            )
        flat = traj.values.astype(np.float64).reshape(n, -1)
        l2[:, j] = np.sqrt(np.einsum("ij,ij->i", flat, flat))
        if n > 1:
            d = np.diff(flat, axis=0)
            upd[1:, j] = np.sqrt(np.einsum("ij,ij->i", d, d))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(l2 > 0, upd / l2, np.nan)
    dims = ("step", "tensor")
    return label_updates(
        xr.Dataset(
            {
                "l2": (dims, l2),
                "update_l2": (dims, upd),
                "update_ratio": (dims, ratio),
                "update_exact": (dims, np.ones_like(l2, dtype=bool)),
            },
            coords={
                "step": ("step", np.array(steps, dtype=np.int64)),
                "tensor": ("tensor", np.array(names, dtype=object)),
            },
            attrs={"source": "tensors"},
        )
    )


def exactness_label(exactness: str) -> str:
    """How the plots and widgets label update numbers of an ``exactness``."""
    return {"estimate": "estimate from probes", "mixed": "partly estimated", "exact": "exact"}.get(
        exactness, "unknown"
    )


def ranked(ratio: Any) -> np.ndarray:  # noqa: ANN401 - array-like
    """Indices of ``ratio`` largest first, the non-finite ones last (in their order)."""
    r = np.asarray(ratio, dtype=float)
    return np.argsort(-np.where(np.isfinite(r), r, -np.inf), kind="stable")


def _previous(run: Run, step: int, timeline: str | None) -> CommitHeader | None:
    line = run.commits(timeline)
    idx = next((i for i, h in enumerate(line) if h.step == step), None)
    return line[idx - 1] if idx else None


def step_change(
    run: Run,
    step: int,
    reference: int | None = None,
    *,
    timeline: str | None = None,
    reference_timeline: str | None = None,
) -> xr.Dataset:
    """Per-parameter change of ``step`` versus ``reference`` (default: the previous commit).

    Variables over ``tensor``: ``delta_l2``, ``norm`` and ``ratio = delta_l2 / norm``. With
    the default reference and a ``summaries`` object at ``step``, they come from the summaries
    (``norm`` is then the current weights' L2, the engine's ``update_ratio`` convention);
    otherwise both commits are diffed exactly and ``norm`` is the reference's L2.
    ``attrs``: ``step``, ``reference`` (None at the first commit: everything NaN),
    ``source``, ``exactness`` (the summaries' own, ``"exact"`` from a diff).
    """
    head = run.at(step, timeline).header
    if reference is None:
        ref = _previous(run, int(head.step), timeline)
        if ref is not None and SUMMARIES_OBJECT in head.objects:
            return _change_from_summaries(run, head, ref, timeline)
    else:
        ref = run.at(reference, reference_timeline or timeline).header
    if ref is None:
        return no_change(param_names(run, step, timeline=timeline), int(head.step))
    return diff_headers(
        run, ref, head, timeline=timeline, reference_timeline=reference_timeline or timeline
    )


def no_change(names: list[str], step: int) -> xr.Dataset:
    """:func:`step_change`'s answer where ``step`` has no reference: NaN for every name."""
    nan = np.full(len(names), np.nan)
    return xr.Dataset(
        {
            "delta_l2": ("tensor", nan),
            "norm": ("tensor", nan.copy()),
            "ratio": ("tensor", nan.copy()),
        },
        coords={"tensor": ("tensor", np.array(names, dtype=object))},
        attrs={"step": step, "reference": None, "source": "none", "exactness": "none"},
    )


def diff_headers(
    run: Run,
    ref: CommitHeader,
    head: CommitHeader,
    *,
    timeline: str | None = None,
    reference_timeline: str | None = None,
) -> xr.Dataset:
    """Exact per-parameter change between two commit headers, read along the timelines they
    were found on (default: the current one). Not ``header.timeline``: that is the name a
    commit was written under, an ancestor's perhaps, since renamed or deleted."""
    tb = timeline or run.timeline
    ta = reference_timeline or tb
    paths = sorted(p for p in set(run.arrays(ref)) | set(run.arrays(head)) if _is_param(p))
    ds = run.diff(int(ref.step), int(head.step), timeline=ta, timeline_b=tb, paths=paths)
    out = xr.Dataset({"delta_l2": ds["delta_l2"], "norm": ds["a_l2"], "ratio": ds["ratio"]})
    out = out.assign_coords(status=ds["status"])
    out.attrs.update(
        step=int(head.step),
        reference=int(ref.step),
        source="tensors",
        timeline=tb,
        reference_timeline=ta,
        exactness="exact",
    )
    return out


def _change_from_summaries(
    run: Run, head: CommitHeader, ref: CommitHeader, timeline: str | None
) -> xr.Dataset:
    tl = timeline or run.timeline
    s = summary_rows(run.at(int(head.step), tl).object(SUMMARIES_OBJECT))
    paths = sorted(p for p in s if _is_param(p))

    def num(v: Any) -> float:  # noqa: ANN401 - a stored summary value
        return math.nan if v is None else float(v)

    upd = np.array([num(s[p].get("update_l2")) for p in paths])
    l2 = np.array([num(s[p].get("l2")) for p in paths])
    ratio = np.array([num(s[p].get("update_ratio")) for p in paths])
    exact = np.array([bool(s[p].get("update_exact", False)) for p in paths], dtype=bool)
    names = np.array([user_name(canonical_path(p)) for p in paths], dtype=object)
    return xr.Dataset(
        {"delta_l2": ("tensor", upd), "norm": ("tensor", l2), "ratio": ("tensor", ratio)},
        coords={"tensor": ("tensor", names)},
        attrs={
            "step": int(head.step),
            "reference": int(ref.step),
            "source": "summaries",
            "exactness": update_exactness(exact, np.isfinite(ratio)),
            "note": ESTIMATE_NOTE,
        },
    )
