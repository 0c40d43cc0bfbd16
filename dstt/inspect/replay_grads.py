"""What a replay shows beyond the verdict: asked-for activations (forward hooks), the
per-tensor gradient, update and weight norms, each sample's loss (and gradient norm) alone
on the weights of the step before, and the gradients as a DataTree in the run's naming.

Each sample is evaluated alone in eval mode after the step (its weights put back after),
so the ranking does not disturb the replayed state. Rejected: per-sample gradients through
``torch.func`` (models with buffers or in-place ops break it; a loop works for all).
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xarray as xr

from dstt.engine.state.model_names import canonical_names
from dstt.errors import ConfigError
from dstt.schema import tensor_path, tree_location

from .replay_data import _batch_size, _slice

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from .replay_kit import LossFn

__all__: list[str] = []


def _hook_activations(
    model: torch.nn.Module, wanted: Iterable[str]
) -> tuple[list[Any], dict[str, list[torch.Tensor]]]:
    wanted = list(wanted)
    if not wanted:
        return [], {}
    named = dict(model.named_modules())
    canon = canonical_names(model, named)
    by_name = {canon[n]: m for n, m in named.items()}
    missing = [w for w in wanted if w not in by_name]
    if missing:
        import difflib

        hints = {w: difflib.get_close_matches(w, list(by_name), n=3) for w in missing}
        raise ConfigError(
            "no module named "
            + "; ".join(
                f"{w!r}" + (f" (did you mean {', '.join(map(repr, h))}?)" if h else "")
                for w, h in hints.items()
            )
        )
    acts: dict[str, list[torch.Tensor]] = {w: [] for w in wanted}

    def keep(name: str) -> Callable[..., None]:
        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                acts[name].append(t.detach().to("cpu", copy=True))

        return hook

    return [by_name[w].register_forward_hook(keep(w)) for w in wanted], acts


def _per_sample(
    model: torch.nn.Module,
    params: list[tuple[str, torch.nn.Parameter]],
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    micro: list[Any],
    sample_ix: list[list[int] | None],
    loss_fn: LossFn,
    grads: bool,
    one: Callable[[Sequence[int]], Any] | None = None,
) -> xr.Dataset:
    """Each sample alone, on the weights of the step before, in eval mode: ``one([i])``
    builds its batch as the step's were built (a collator pads it alone), else it is sliced
    out of its micro-batch."""
    with torch.no_grad():
        for n, p in params:
            p.copy_(before[n])
    model.eval()
    index: list[int] = []
    mb: list[int] = []
    loss_v: list[float] = []
    gnorm: list[float] = []
    try:
        for m, (b, ix) in enumerate(zip(micro, sample_ix, strict=True)):
            count = len(ix) if ix is not None and one is not None else _batch_size(b)
            for i in range(count):
                alone = one([ix[i]]) if ix is not None and one is not None else _slice(b, i)
                for _, p in params:
                    p.grad = None
                with contextlib.nullcontext() if grads else torch.no_grad():
                    loss = loss_fn(model, alone)
                    loss = loss.mean() if loss.dim() else loss
                if grads:
                    loss.backward()
                    sq = sum(
                        float(p.grad.double().pow(2).sum()) for _, p in params if p.grad is not None
                    )
                    gnorm.append(math.sqrt(sq))
                else:
                    gnorm.append(math.nan)
                loss_v.append(float(loss.detach()))
                index.append(ix[i] if ix is not None else -1)
                mb.append(m)
    finally:
        for _, p in params:
            p.grad = None
        with torch.no_grad():
            for n, p in params:
                p.copy_(after[n])
    order = np.argsort(
        -np.nan_to_num(np.asarray(loss_v, dtype=np.float64), nan=-np.inf), kind="stable"
    )
    return xr.Dataset(
        {
            "loss": ("sample", np.asarray(loss_v)[order]),
            "grad_norm": ("sample", np.asarray(gnorm)[order]),
        },
        coords={
            "index": ("sample", np.asarray(index, dtype=np.int64)[order]),
            "micro_batch": ("sample", np.asarray(mb, dtype=np.int64)[order]),
            "position": ("sample", np.arange(len(index), dtype=np.int64)[order]),
        },
        attrs={
            "order": "worst first (largest loss)",
            "mode": "eval (no dropout), weights of the step before",
        },
    )


def _empty_samples() -> xr.Dataset:
    return xr.Dataset(
        {"loss": ("sample", np.zeros(0)), "grad_norm": ("sample", np.zeros(0))},
        coords={
            "index": ("sample", np.zeros(0, np.int64)),
            "micro_batch": ("sample", np.zeros(0, np.int64)),
            "position": ("sample", np.zeros(0, np.int64)),
        },
    )


def _norms(
    grads: Mapping[str, torch.Tensor],
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
) -> xr.Dataset:
    names = sorted(grads)

    def norm(t: torch.Tensor) -> float:
        return float(t.detach().double().norm()) if t.numel() else 0.0

    g = np.array([norm(grads[n]) for n in names])
    u = np.array([norm(after[n].double() - before[n].double()) for n in names])
    w = np.array([norm(before[n]) for n in names])
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(w > 0, u / w, np.nan)
    return xr.Dataset(
        {
            "grad_norm": ("tensor", g),
            "update_norm": ("tensor", u),
            "weight_norm": ("tensor", w),
            "update_ratio": ("tensor", ratio),
        },
        coords={
            "tensor": ("tensor", np.asarray(names, dtype=object)),
            "store_path": (
                "tensor",
                np.asarray([tensor_path("params", n) for n in names], dtype=object),
            ),
        },
        attrs={"update_ratio": "exact: ||w_k - w_{k-1}|| / ||w_{k-1}||"},
    )


def _grad_tree(grads: Mapping[str, torch.Tensor], table: Mapping[str, Any]) -> xr.DataTree:
    """The gradients as a DataTree mirroring module paths, with the stored dims."""
    nodes: dict[str, dict[str, xr.DataArray]] = {}
    for name, g in grads.items():
        path = tensor_path("params", name)
        node, var = tree_location(path)
        rec = table.get(path)
        dims = tuple(getattr(rec, "dims", None) or ()) or tuple(
            f"{var}_{i}" for i in range(g.dim())
        )
        arr = g.detach().cpu()
        data = (arr.float() if arr.dtype in (torch.bfloat16, torch.float16) else arr).numpy()
        nodes.setdefault(node, {})[var] = xr.DataArray(data, dims=dims[: g.dim()])
    tree: dict[str, xr.Dataset] = {"/": xr.Dataset()}
    for node, vars_ in nodes.items():
        tree["/" + node if node else "/"] = xr.Dataset(vars_)
    return xr.DataTree.from_dict(tree)
