"""Replay a past step: recompute its gradients, per-sample losses and activations exactly.

:func:`replay_step` restores commit *k-1* into live objects with the providers a resume uses,
rebuilds step *k*'s micro-batches from their recorded samples (``replay_data``), runs
forward/backward and the optimizer step through a :class:`ReplayKit` (``replay_kit``),
compares every tensor with commit *k* bit for bit (``replay_compare``: ``Replay.faithful``,
else ``Replay.mismatch`` with a likely reason) and evaluates each sample alone on the
weights of *k-1* (``replay_grads``). Nothing is written to the run.
Rejected: storing gradients and activations at capture time (far more bytes than the state,
for the few steps anyone studies); importing the integrations here (they sit above this
layer). History: docs/decisions.md, "Replay and import".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import nan
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dstt.engine.state.model_names import param_names
from dstt.engine.state.optimizers import optimizers_of
from dstt.errors import ConfigError, ReplayError, StepNotFoundError
from dstt.schema import tensor_path

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    import xarray as xr

    from dstt.store._internal import CommitHeader, Reader

from .replay_compare import Mismatch, TensorDiff, _compare
from .replay_data import _step_batches
from .replay_grads import _empty_samples, _grad_tree, _hook_activations, _norms, _per_sample
from .replay_kit import (
    LossFn,
    ReplayKit,
    _backward,
    _default_loss,
    _kit_of,
    _restore,
    register_replay_kit,
    replay_kit_for,
)

__all__ = [
    "Mismatch",
    "Replay",
    "ReplayKit",
    "TensorDiff",
    "register_replay_kit",
    "replay_kit_for",
    "replay_step",
]


@dataclass
class Replay:
    """What replaying step ``step`` found (see the module docstring).

    ``faithful``: the replayed parameters and optimizer state equal commit ``step`` bit for
    bit; ``max_abs_diff`` the largest difference over them (0.0 when faithful) and
    ``differs`` the tensors that differ; ``mismatch`` (None when faithful) says by how much
    each differs and the likely reason, as ``explain()`` and the repr do. ``losses``: the
    loss of each micro-batch.
    ``grads``: the step's gradients (summed over micro-batches, as the optimizer saw them) as
    a DataTree in the run's naming (``replay.layer("layers.0")`` as for a snapshot);
    ``norms``: per tensor ``grad_norm``, ``update_norm``, ``weight_norm`` and
    ``update_ratio``; ``per_sample``: each sample's ``loss`` (and ``grad_norm``), worst first,
    with its ``index`` in the dataset (-1 where unknown: given batches the step did not
    record), ``micro_batch`` and ``position`` in the step's batches. ``activations``: per
    module name asked for, its output for each micro-batch.
    """

    step: int
    faithful: bool
    max_abs_diff: float
    differs: list[str]
    losses: list[float]
    norms: xr.Dataset
    per_sample: xr.Dataset
    activations: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    mismatch: Mismatch | None = None
    _grads: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _table: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def grads(self) -> xr.DataTree:
        return _grad_tree(self._grads, self._table)

    def grad(self, name: str) -> torch.Tensor:
        """One tensor's gradient (its dotted name)."""
        try:
            return self._grads[name]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(name, list(self._grads), n=3)
            raise ConfigError(
                f"no parameter named {name!r} in the replay"
                + (f"; did you mean {', '.join(map(repr, close))}?" if close else "")
            ) from None

    def worst(self, n: int = 1) -> list[int]:
        """The dataset indices of the ``n`` samples with the largest loss: pass them to
        ``run.rollback(to, skip_samples=...)``. ``ReplayError`` when the replay had no
        indices for them (batches given that the step did not record)."""
        got = [int(i) for i in self.per_sample["index"].values[:n]]
        if any(i < 0 for i in got):
            raise ReplayError(
                f"the dataset indices of step {self.step}'s samples are unknown: the replay "
                "was given batches= that do not match the step's recorded ones; "
                "per_sample['position'] holds their positions in those batches"
            )
        return got

    def layer(self, selector: str) -> xr.DataTree:
        """The gradients of the tensors ``selector`` picks (the snapshot selection rule)."""
        from .selection import select, selector_miss

        paths = [tensor_path("params", n) for n in self._grads]
        picked = select(selector, paths)
        if not picked:
            raise selector_miss(selector, paths, f"in the gradients of step {self.step}")
        keep = {p.partition("/")[2].replace("/", ".") for p in picked}
        return _grad_tree({n: g for n, g in self._grads.items() if n in keep}, self._table)

    def top(self, n: int = 10, by: str = "grad_norm") -> list[tuple[str, float]]:
        """The ``n`` tensors with the largest ``by`` (``grad_norm``, ``update_ratio``)."""
        v = self.norms[by].values
        order = np.argsort(-np.nan_to_num(v, nan=-np.inf))[:n]
        names = self.norms["tensor"].values
        return [(str(names[i]), float(v[i])) for i in order]

    def explain(self) -> str:
        """Whether the replay is faithful and, where not, which tensors differ (largest
        first) and the likely reason."""
        if self.mismatch is None:
            return f"step {self.step}: faithful: bit-exact against its commit"
        return f"step {self.step}: NOT faithful. {self.mismatch}"

    def __repr__(self) -> str:
        verdict = "faithful"
        if self.mismatch is not None:
            top = ", ".join(f"{p} {d:.3g}" for p, d in self.mismatch.top(3))
            verdict = (
                f"NOT faithful (max |diff| {self.max_abs_diff:.3g}; {top}"
                f"{' ...' if len(self.mismatch.tensors) > 3 else ''}; "
                f"likely: {self.mismatch.reason})"
            )
        worst = ", ".join(
            f"{i}: {loss:.4g}"
            for i, loss in zip(
                self.per_sample["index"].values[:3],
                self.per_sample["loss"].values[:3],
                strict=False,
            )
        )
        return (
            f"Replay(step {self.step}: {verdict}; {len(self.losses)} micro-batch(es), "
            f"losses {[round(x, 6) for x in self.losses]}; worst samples {worst})"
        )


def _prev_header(line: Sequence[Any], step: int) -> tuple[Any, Any]:
    """(commit of ``step``, commit of ``step - 1``) on the timeline ``line``."""
    by_step = {int(h.step): h for h in line}
    if step not in by_step:
        raise StepNotFoundError(
            f"step {step} is not committed on this timeline; replay needs "
            "the step itself (to check the replay) and the one before it"
        )
    if step - 1 not in by_step:
        raise ReplayError(
            f"step {step - 1} is not committed (committed steps near {step}: "
            f"{[s for s in sorted(by_step) if abs(s - step) <= 5]}): replaying step {step} "
            f"starts from the state after step {step - 1}; capture every step (every=1) or "
            "replay a step whose predecessor was committed"
        )
    prev = by_step[step - 1]
    if getattr(prev, "pruned", False):
        raise ReplayError(
            f"step {step - 1} was pruned by gc (its tensors are gone); replay a "
            "step whose predecessor is kept (Retention keeps spike windows)"
        )
    return by_step[step], prev


def replay_step(
    run: Any,
    reader: Reader,
    step: int,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    *,
    kit: ReplayKit | None = None,
    before_step: Callable[[], None] | None = None,
    scheduler: Any = None,
    loss_fn: LossFn | None = None,
    batches: Any = None,
    dataset: Any = None,
    collate: Callable[[list[Any]], Any] | None = None,
    activations: Iterable[str] = (),
    per_sample: bool = True,
    per_sample_grads: bool = False,
    timeline: str | None = None,
    trusted: bool = False,
) -> Replay:
    """Replay step ``step`` of ``run`` (read with ``reader``, the run's own) into
    ``model``/``optimizer``, or through a framework's ``kit`` (see the module docstring and
    :class:`Replay`). ``before_step`` runs between the last backward and the optimizer step
    (the loop's gradient clipping); explicit ``scheduler``, ``before_step``, ``loss_fn`` and
    data arguments take the place of what ``kit`` supplies."""
    kit = _kit_of(kit, model, optimizer, scheduler, before_step, loss_fn)
    model, optimizer = kit.model, kit.optimizer
    timeline = timeline or run.timeline
    line = run.commits(timeline)
    light = _light_around(run, line, int(step), timeline)
    head_k: CommitHeader | None
    if light is None:
        head_k, head_prev = _prev_header(line, int(step))
    else:  # step or the one before it is light (every="auto"): rebuild the one before
        from .rebuild import rebuild_step

        head_k = next((h for h in line if int(h.step) == int(step)), None)
        rebuild_step(
            run,
            reader,
            int(step) - 1,
            kit=kit,
            loss_fn=loss_fn,
            batches=batches if callable(batches) else None,
            dataset=dataset,
            collate=collate,
            timeline=timeline,
            trusted=trusted,
        )
    loss_fn = loss_fn or _default_loss
    micro, sample_ix, one = _step_batches(
        run, int(step), timeline, batches, dataset, collate, kit.make_batch
    )
    if light is None:
        _restore(kit, reader, head_prev, trusted)
    names = param_names(model)
    params = [(names[id(p)], p) for p in model.parameters() if id(p) in names]
    before = {n: p.detach().clone() for n, p in params}
    hooks, acts = _hook_activations(model, activations)
    was_training = model.training
    model.train()
    try:
        for opt in optimizers_of(optimizer).values():
            opt.zero_grad(set_to_none=True)
        losses = _backward(kit, micro, loss_fn)
    finally:
        for h in hooks:
            h.remove()
    if kit.before_step is not None:
        kit.before_step()
    grads = {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in params
    }
    for opt in optimizers_of(optimizer).values():
        opt.step()
    after = {n: p.detach().clone() for n, p in params}
    if head_k is not None:
        mismatch = _compare(reader, head_k, model, optimizer, names, grads)
    else:  # a light step: no stored tensors; its logged loss is the check
        mismatch = _light_mismatch(int(step), light, losses)
    sample_fn: LossFn = loss_fn
    if kit.sample_loss is not None:
        sample_loss = kit.sample_loss

        def sample_fn(_m: torch.nn.Module, b: Any) -> torch.Tensor:
            return sample_loss(b)

    samples = (
        _per_sample(
            model, params, before, after, micro, sample_ix, sample_fn, per_sample_grads, one
        )
        if per_sample
        else _empty_samples()
    )
    model.train(was_training)
    table = reader.arrays(head_k or max((h for h in line if h.step < step), key=lambda h: h.step))
    return Replay(
        step=int(step),
        faithful=mismatch is None,
        max_abs_diff=(
            0.0
            if mismatch is None
            else max((d.max_abs_diff for d in mismatch.tensors), default=nan)
        ),
        differs=sorted(d.path for d in mismatch.tensors) if mismatch else [],
        mismatch=mismatch,
        losses=losses,
        norms=_norms(grads, before, after),
        per_sample=samples,
        activations=acts,
        _grads=grads,
        _table=table,
    )


def _light_around(
    run: Any, line: Sequence[Any], step: int, timeline: str
) -> dict[int, str | None] | None:
    """The run's light steps (``{step: loss fingerprint}``) when ``step`` or the step before
    it is one (not stored), else None: the plain replay from commit ``step - 1``."""
    stored = {int(h.step) for h in line}
    if step in stored and step - 1 in stored:
        return None
    light: dict[int, str | None] = run.light_steps(timeline)
    if (step in light or step in stored) and (step - 1 in light or step - 1 in stored):
        return light
    return None


def _light_mismatch(step: int, light: dict[int, str | None] | None, losses: list[float]) -> Any:
    """None when the replayed losses of light ``step`` give the loss it logged, bit for bit;
    else the :class:`Mismatch` saying so (no stored tensors to compare with)."""
    from .rebuild import _matches

    bits = (light or {}).get(step)
    if bits is not None and _matches(bits, losses, None):
        return None
    got = losses[-1] if losses else None
    what = (
        "logged no loss to check the replay with"
        if bits is None
        else f"logged another loss than the replay's {got!r}: it did not train as replayed "
        "(other data, loss_fn, clipping)"
    )
    return Mismatch(
        [], 0, f"step {step} is a light step (every='auto': no stored tensors); it {what}"
    )
