"""Whether a replay is faithful: every parameter and optimizer-state tensor against the
commit, bit for bit, and where not, the likely reason from the pattern of differences.

A difference that is one multiple of the gradient points to clipping or loss scaling, a
parameter-only difference to the learning rate, tiny ones to nondeterministic kernels
(docs/replay.md). Rejected: a tolerance (``allclose``) — a rebuilt chain must equal the
run bit for bit, or every step after it drifts unseen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dstt.engine.state.optimizers import optimizers_of
from dstt.engine.state.providers import StoreSource
from dstt.schema import tensor_path

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["Mismatch", "TensorDiff"]


@dataclass(frozen=True)
class TensorDiff:
    """One stored tensor the replay did not reproduce: its store ``path``, the largest
    absolute difference (inf: another shape or dtype), that relative to the stored tensor's
    largest magnitude, and how the difference lines up with the replayed gradient of its
    parameter (``cosine``, and ``scale``: the ``a`` of ``difference ~ a * gradient``)."""

    path: str
    max_abs_diff: float
    relative: float
    cosine: float = math.nan
    scale: float = math.nan


@dataclass(frozen=True)
class Mismatch:
    """Why a replay is not faithful: the ``tensors`` that differ, largest difference first,
    of ``compared`` stored tensors, and the ``reason`` their pattern points to."""

    tensors: list[TensorDiff]
    compared: int
    reason: str

    def top(self, n: int = 5) -> list[tuple[str, float]]:
        """``(path, max |diff|)`` of the ``n`` tensors that differ most."""
        return [(d.path, d.max_abs_diff) for d in self.tensors[:n]]

    def __str__(self) -> str:
        lines = [
            f"{len(self.tensors)} of {self.compared} tensors differ from the commit; "
            "largest |diff|:"
        ]
        lines += [f"  {p}  {d:.3g}" for p, d in self.top(5)]
        if len(self.tensors) > 5:
            lines.append(f"  ... and {len(self.tensors) - 5} more (Replay.mismatch.tensors)")
        lines.append(f"likely: {self.reason}")
        return "\n".join(lines)


_SAME_DIRECTION = 0.999  # |cosine| of a difference with the gradient: "a multiple of it"
_SAME_SCALE = 1e-2  # relative spread of those multiples across tensors: "one factor"
_TINY = 1e-4  # largest relative difference a nondeterministic kernel leaves


def _compare(
    reader: Reader,
    head: CommitHeader,
    model: torch.nn.Module,
    optimizer: Any,
    names: Mapping[int, str],
    grads: Mapping[str, torch.Tensor],
) -> Mismatch | None:
    """Every parameter and optimizer-state tensor against commit ``head``; None when all
    are bit-exact, else what differs and the likely reason."""
    source = StoreSource(reader, head)
    live: dict[str, tuple[torch.Tensor, str]] = {}  # path -> (tensor, its parameter's name)
    for param in model.parameters():
        if id(param) in names:
            live[tensor_path("params", names[id(param)])] = (param.detach(), names[id(param)])
    for opt in optimizers_of(optimizer).values():
        for owner, st in opt.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and id(owner) in names:
                    path = tensor_path(f"optim/{key}", names[id(owner)])
                    live[path] = (v.detach(), names[id(owner)])
    diffs: list[TensorDiff] = []
    compared = 0
    for path, (t, owner_name) in live.items():
        if not source.has_array(path):
            continue
        compared += 1
        stored = source.array(path)
        same = (
            stored.dtype == t.dtype
            and stored.shape == t.shape
            and torch.equal(
                stored.reshape(-1).view(torch.uint8) if stored.numel() else stored,
                t.cpu().contiguous().reshape(-1).view(torch.uint8) if t.numel() else t.cpu(),
            )
        )
        if not same:
            diffs.append(_tensor_diff(path, stored, t.cpu(), grads.get(owner_name)))
    if not diffs:
        return None
    diffs.sort(key=lambda d: (-d.max_abs_diff, d.path))
    return Mismatch(diffs, compared, _reason(diffs, live))


def _tensor_diff(
    path: str, stored: torch.Tensor, live: torch.Tensor, grad: torch.Tensor | None
) -> TensorDiff:
    if stored.shape != live.shape or not stored.is_floating_point() or stored.numel() == 0:
        return TensorDiff(path, math.inf, math.inf)
    d = stored.double() - live.double()
    max_abs = float(d.abs().max())
    peak = float(stored.double().abs().max())
    relative = max_abs / peak if peak > 0 else math.inf
    cosine = scale = math.nan
    if grad is not None and grad.shape == d.shape:
        g = grad.detach().cpu().double().reshape(-1)
        flat = d.reshape(-1)
        gg, dd = float(g @ g), float(flat @ flat)
        if gg > 0 and dd > 0:
            dot = float(g @ flat)
            cosine, scale = dot / math.sqrt(gg * dd), dot / gg
    return TensorDiff(path, max_abs, relative, cosine, scale)


def _reason(diffs: list[TensorDiff], live: Mapping[str, Any]) -> str:
    """The likely reason for the pattern of differences (see docs/replay.md)."""
    if any(math.isinf(d.max_abs_diff) for d in diffs):
        return (
            "stored tensors have another shape or dtype: the model or optimizer was not built "
            "as the training run built them"
        )
    kinds: dict[str, list[TensorDiff]] = {}  # "params", "optim/exp_avg", ...
    for d in diffs:
        kind = "params" if d.path.startswith("params/") else "/".join(d.path.split("/")[:2])
        kinds.setdefault(kind, []).append(d)
    states = {p for p in live if p.startswith("optim/")}
    if set(kinds) == {"params"} and states:
        return (
            "the optimizer state (moments) matches training bit for bit but the parameter "
            "update does not: the step ran with another learning rate (or weight decay) than "
            "training's; build the optimizer's param groups and the scheduler as the run did "
            "and pass scheduler="
        )
    clipping = (
        "gradients were clipped (scaled by one common factor) between backward and step in "
        "training: pass before_step= (e.g. lambda: torch.nn.utils.clip_grad_norm_(...)) or "
        "trainer=; or the loss was scaled differently (the division by gradient accumulation)"
    )
    for kind, group in sorted(kinds.items()):
        if _one_factor(group):
            if kind == "params" and not states:
                return clipping + "; or the learning rate differs"
            return clipping
    worst = max(d.relative for d in diffs)
    if worst < _TINY:
        return (
            f"tiny differences (largest {worst:.2g} of the tensor's magnitude): "
            "nondeterministic kernels (GPU atomics, cuBLAS/cuDNN algorithm choice) or another "
            "thread count (torch.set_num_threads); the step itself was recomputed as it ran"
        )
    return (
        "the recomputed gradients differ from training's: other data (batches, collate), "
        "another loss_fn (scaling), other model code, or RNG drawn between the steps "
        "(see docs/replay.md, 'What makes a replay faithful')"
    )


def _one_factor(group: list[TensorDiff]) -> bool:
    """Each difference is a multiple of its parameter's gradient, with one common factor."""
    if not group or any(not abs(d.cosine) >= _SAME_DIRECTION for d in group):
        return False
    scales = [d.scale for d in group]
    lo, hi = min(scales), max(scales)
    return bool(lo * hi > 0 and (hi - lo) <= _SAME_SCALE * max(abs(lo), abs(hi)))
