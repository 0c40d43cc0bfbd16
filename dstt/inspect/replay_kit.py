"""How a step is run for replay: the :class:`ReplayKit` a framework registers, and the kit
a call runs (a framework's, with the caller's arguments in its place, or a plain loop's).

A kit is the few callables that differ between frameworks (build a micro-batch from sample
indices, forward + backward, what runs before ``optimizer.step()``); the rest of a replay
is the same for all. Integrations register theirs here (``register_replay_kit``), so this
layer never imports them. Rejected: a replay per framework (three copies of the restore,
the comparison and the per-sample pass, drifting apart).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dstt.engine.state.optimizers import optimizers_of
from dstt.engine.state.providers import StoreSource
from dstt.engine.state.torch_state import discover
from dstt.errors import ConfigError

if TYPE_CHECKING:
    from dstt.store._internal import CommitHeader, Reader

__all__ = ["LossFn", "ReplayKit", "register_replay_kit", "replay_kit_for"]

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
    given = {"scheduler": scheduler, "before_step": before_step}
    changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if loss_fn is not None:  # the caller's loss replaces the framework's
        changes.update(backward=None, sample_loss=None)
    return replace(kit, **changes) if changes else kit


def _restore(kit: ReplayKit, reader: Reader, header: CommitHeader, trusted: bool) -> StoreSource:
    """Restore commit ``header`` into the kit's live objects, as a resume does."""
    state = discover(kit.model, kit.optimizer, scheduler=kit.scheduler)
    source = StoreSource(reader, header, prefetch=True, trusted=trusted)
    state.step_state.restore(source)
    state.boundary_state.restore(source)
    return source


def _backward(kit: ReplayKit, micro: list[Any], loss_fn: LossFn) -> list[float]:
    """Forward and backward of each micro-batch (the gradients accumulate); their losses."""
    losses: list[float] = []
    for b in micro:
        if kit.backward is not None:
            loss = kit.backward(b)
        else:
            loss = loss_fn(kit.model, b)
            if loss.dim() > 0:  # per-sample losses: back-propagate their mean
                loss = loss.mean()
            loss.backward()
        losses.append(float(loss.detach().float().mean()))
    return losses


def _optimizer_step(kit: ReplayKit) -> None:
    """What the loop runs after the last backward: ``before_step``, each optimizer's step,
    the scheduler's."""
    if kit.before_step is not None:
        kit.before_step()
    for opt in optimizers_of(kit.optimizer).values():
        opt.step()
    if kit.scheduler is not None:
        kit.scheduler.step()
