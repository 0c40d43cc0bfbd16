"""Replay a past step: recompute its gradients, per-sample losses and activations exactly.

:func:`replay_step` restores commit *k-1* into live objects with the providers a resume uses,
rebuilds step *k*'s micro-batches from their recorded samples, runs forward/backward and the
optimizer step (capturing gradients and asked-for activations), then compares every tensor
with commit *k* bit for bit (``Replay.faithful``, else ``Replay.mismatch`` with a likely
reason) and evaluates each sample alone on the weights of *k-1*. Nothing is written to the
run. Frameworks run a step through a :class:`ReplayKit` their integration registers.

Rejected: storing gradients and activations at capture time (far more bytes than the state,
for the few steps anyone studies); importing the integrations here (they sit above this
layer). History: docs/decisions.md, "Replay and import".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xarray as xr

from dstt.engine.model_names import canonical_names, param_names
from dstt.engine.optimizers import optimizers_of
from dstt.engine.providers import StoreSource
from dstt.engine.torch_state import discover
from dstt.errors import ConfigError, ReplayError, StepNotFoundError
from dstt.schema import tensor_path, tree_location

if TYPE_CHECKING:
    from dstt.store._internal import CommitHeader, Reader

__all__ = [
    "Mismatch",
    "Replay",
    "ReplayKit",
    "TensorDiff",
    "register_replay_kit",
    "replay_kit_for",
    "replay_step",
]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class ReplayKit:
    """How a framework runs one optimizer step, for replay.

    ``model``: the module the optimizer updates (unwrapped: no DDP/accelerate wrapper);
    ``optimizer``: what ``dstt.session`` takes (a torch optimizer, a list or a dict of them);
    ``scheduler``: its LR scheduler, if any. ``make_batch(indices)``: the dataset indices of
    ONE micro-batch -> that batch exactly as the framework fed it (collator applied).
    ``backward(batch)``: forward + backward of one micro-batch exactly as the framework does
    it (its loss, autocast, loss scaling, division by gradient accumulation), returning the
    loss (detached); None: ``loss_fn(model, batch).backward()``. ``before_step()``: what runs
    between the last backward and ``optimizer.step()`` (gradient clipping). ``sample_loss(b)``:
    the loss of a one-sample batch ``b = make_batch([i])`` (with its graph, so per-sample
    gradients can be taken), for the per-sample ranking; None: ``loss_fn`` on it.
    """

    model: torch.nn.Module
    optimizer: Any
    scheduler: Any = None
    make_batch: Callable[[Sequence[int]], Any] | None = None
    backward: Callable[[Any], torch.Tensor] | None = None
    before_step: Callable[[], None] | None = None
    sample_loss: Callable[[Any], torch.Tensor] | None = None


KitBuilder = Callable[[object, object | None], ReplayKit]
_KITS: list[tuple[Callable[[object], bool], KitBuilder]] = []

#: where the kit of a trainer from a known framework is registered (top-level package -> how)
_KNOWN = {
    "transformers": "import dstt.integrations.transformers",
    "lightning": "import dstt.integrations.lightning (and pass module=the LightningModule)",
    "pytorch_lightning": "import dstt.integrations.lightning (and pass module=the LightningModule)",
}


def register_replay_kit(
    matches: Callable[[object], bool],
    build: Callable[[object, object | None], ReplayKit],
) -> None:
    """Make ``run.replay(k, trainer=t, module=m)`` use ``build(t, m)`` for every trainer ``t``
    with ``matches(t)``. The newest registration is asked first (a user's own kit overrides
    an integration's)."""
    _KITS.insert(0, (matches, build))


def replay_kit_for(trainer: object, module: object | None = None) -> ReplayKit:
    """The :class:`ReplayKit` of ``trainer`` (and ``module``, for frameworks whose trainer
    does not hold the model) from the registered builders; ``ConfigError`` naming the
    trainer's type and which import registers its kit when none matches."""
    for matches, build in _KITS:
        if matches(trainer):
            kit = build(trainer, module)
            if not isinstance(kit, ReplayKit):
                raise ConfigError(
                    f"the replay kit builder for a {_type_name(trainer)} returned a "
                    f"{type(kit).__name__}, not a dstt.inspect.replay.ReplayKit"
                )
            return kit
    top = type(trainer).__module__.partition(".")[0]
    how = _KNOWN.get(top)
    hint = (
        f"`{how}` registers it"
        if how
        else "register one with dstt.inspect.replay.register_replay_kit(matches, build)"
    )
    raise ConfigError(
        f"no replay kit for trainer= of type {_type_name(trainer)}: {hint}; or replay a plain "
        "loop with run.replay(k, model, optimizer, loss_fn=..., before_step=...)"
    )


def _type_name(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


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


def _prev_header(reader: Reader, line: Sequence[Any], step: int) -> tuple[Any, Any]:
    """(commit of ``step``, commit of ``step - 1``) on the timeline ``line``."""
    by_step = {int(h.step): h for h in line}
    if step not in by_step:
        raise StepNotFoundError(
            f"step {step} is not committed on this timeline; replay needs "
            "the step itself (to check the replay) and the one before it"
        )
    if step - 1 not in by_step:
        have = sorted(by_step)
        raise ReplayError(
            f"step {step - 1} is not committed (committed steps near {step}: "
            f"{[s for s in have if abs(s - step) <= 5]}): replaying step {step} starts from "
            f"the state after step {step - 1}; capture every step (every=1) or replay a step "
            "whose predecessor was committed"
        )
    prev = by_step[step - 1]
    if getattr(prev, "pruned", False):
        raise ReplayError(
            f"step {step - 1} was pruned by gc (its tensors are gone); replay a "
            "step whose predecessor is kept (Retention keeps spike windows)"
        )
    return by_step[step], prev


def _slice(batch: Any, i: int) -> Any:
    """Sample ``i`` of a batch (tensors, arrays, dicts, lists/tuples of them; dim 0),
    keeping a batch dimension of 1."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return batch[i : i + 1]
    if isinstance(batch, Mapping):
        return type(batch)({k: _slice(v, i) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, list | tuple):
        return type(batch)(_slice(v, i) for v in batch)
    return batch


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor | np.ndarray):
        return int(batch.shape[0])
    if isinstance(batch, Mapping):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, list | tuple) and batch:
        return _batch_size(batch[0])
    raise ReplayError(
        f"cannot tell the batch size of a {type(batch).__name__}: per-sample "
        "losses need tensors (or dicts/tuples of them) with the batch on dim 0"
    )


def _default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, tuple) and len(out) == 2:
        loss = out[1]  # (logits, loss), as dstt.testing.models.TinyGPT
    if not isinstance(loss, torch.Tensor):
        raise ConfigError(
            "replay needs loss_fn=(model, batch) -> the loss your loop "
            "back-propagated (the model's output has no .loss)"
        )
    return loss


def _step_batches(
    run: Any,
    step: int,
    timeline: str | None,
    batches: Any,
    dataset: Any,
    collate: Callable[[list[Any]], Any] | None,
    make_batch: Callable[[Sequence[int]], Any] | None = None,
) -> tuple[list[Any], list[list[int] | None], Callable[[Sequence[int]], Any] | None]:
    """Step ``step``'s micro-batches, each one's sample indices (None when unknown) and the
    function from indices to a batch they were built with (None for given batches).

    The batches come from, in this order: ``batches`` (the batches, or a callable from
    indices), ``dataset`` (with ``collate``), the kit's ``make_batch``."""
    recorded = run.batches([step], timeline=timeline).get(step)
    if batches is not None and not callable(batches):
        got = list(batches)
        return got, _given_indices(recorded, got), None
    if not recorded:
        raise ReplayError(
            f"step {step} has no recorded batches: the run was captured without data "
            "attribution. Wrap the loader as `for batch in s.data(loader):` in the session "
            "(or pass replay(..., batches=[the step's batches]))"
        )
    indices = [list(b.indices) if b.indices is not None else None for b in recorded]
    if any(ix is None for ix in indices):
        raise ReplayError(
            f"step {step}'s batches were recorded by hash, not by sample indices (the loader "
            "is not a DataLoader over a map-style dataset): pass replay(..., batches=[...])"
        )
    known = [ix for ix in indices if ix is not None]
    build: Callable[[Sequence[int]], Any]
    if callable(batches):
        build = batches
    elif dataset is not None:
        join = collate
        if join is None:
            from torch.utils.data import default_collate

            join = default_collate

        def build(ix: Sequence[int]) -> Any:
            return join([dataset[i] for i in ix])

    elif make_batch is not None:
        build = make_batch
    else:
        raise ConfigError(
            "replay needs the data: dataset=... (with collate=...) to rebuild "
            "the step's batches from their sample indices, or batches="
        )
    return [build(ix) for ix in known], list(indices), build


def _given_indices(recorded: list[Any] | None, got: list[Any]) -> list[list[int] | None]:
    """The dataset indices of batches given to the replay: the step's recorded ones where
    they fit (as many micro-batches, each of the recorded size), else unknown."""
    unknown: list[list[int] | None] = [None] * len(got)
    if not recorded or len(recorded) != len(got) or any(b.indices is None for b in recorded):
        return unknown
    try:
        sizes = [_batch_size(b) for b in got]
    except ReplayError:
        return unknown
    indices = [list(b.indices) for b in recorded]
    return list(indices) if [len(ix) for ix in indices] == sizes else unknown


def _kit_of(
    kit: ReplayKit | None,
    model: torch.nn.Module | None,
    optimizer: Any,
    scheduler: Any,
    before_step: Callable[[], None] | None,
    loss_fn: LossFn | None,
) -> ReplayKit:
    """The kit the replay runs: ``kit`` (a framework's) with the explicit arguments in place
    of what it supplies, or a plain loop's from ``model`` and ``optimizer``."""
    if kit is None:
        if model is None or optimizer is None:
            raise ConfigError(
                "replay needs the live objects to replay into: model= and optimizer= (built "
                "as the training script built them), or trainer= (an HF or Lightning Trainer)"
            )
        return ReplayKit(model, optimizer, scheduler, before_step=before_step)
    if model is not None or optimizer is not None:
        raise ConfigError(
            "replay takes either trainer= (its kit supplies the model and optimizer) or "
            "model= and optimizer=, not both"
        )
    changes: dict[str, Any] = {}
    if scheduler is not None:
        changes["scheduler"] = scheduler
    if before_step is not None:
        changes["before_step"] = before_step
    if loss_fn is not None:  # the caller's loss replaces the framework's
        changes.update(backward=None, sample_loss=None)
    return replace(kit, **changes) if changes else kit


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
    head_k, head_prev = _prev_header(reader, run.commits(timeline), int(step))
    loss_fn = loss_fn or _default_loss
    micro, sample_ix, one = _step_batches(
        run, int(step), timeline, batches, dataset, collate, kit.make_batch
    )
    state = discover(model, optimizer, scheduler=kit.scheduler)
    source = StoreSource(reader, head_prev, prefetch=True, trusted=trusted)
    state.step_state.restore(source)
    state.boundary_state.restore(source)
    names = param_names(model)
    params = [(names[id(p)], p) for p in model.parameters() if id(p) in names]
    before = {n: p.detach().clone() for n, p in params}
    hooks, acts = _hook_activations(model, activations)
    was_training = model.training
    model.train()
    losses: list[float] = []
    try:
        for opt in optimizers_of(optimizer).values():
            opt.zero_grad(set_to_none=True)
        for b in micro:
            if kit.backward is not None:
                loss = kit.backward(b)
            else:
                loss = loss_fn(model, b)
                if loss.dim() > 0:  # per-sample losses: back-propagate their mean
                    loss = loss.mean()
                loss.backward()
            losses.append(float(loss.detach().float().mean()))
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
    mismatch = _compare(reader, head_k, model, optimizer, names, grads)
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
    table = reader.arrays(head_k)
    return Replay(
        step=int(step),
        faithful=mismatch is None,
        max_abs_diff=mismatch.tensors[0].max_abs_diff if mismatch else 0.0,
        differs=sorted(d.path for d in mismatch.tensors) if mismatch else [],
        mismatch=mismatch,
        losses=losses,
        norms=_norms(grads, before, after),
        per_sample=samples,
        activations=acts,
        _grads=grads,
        _table=table,
    )


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
                if grads:
                    for _, p in params:
                        p.grad = None
                    loss = loss_fn(model, alone)
                    loss = loss.mean() if loss.dim() else loss
                    loss.backward()
                    sq = sum(
                        float(p.grad.double().pow(2).sum()) for _, p in params if p.grad is not None
                    )
                    gnorm.append(math.sqrt(sq))
                else:
                    with torch.no_grad():
                        loss = loss_fn(model, alone)
                        loss = loss.mean() if loss.dim() else loss
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
