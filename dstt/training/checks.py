"""What the session refuses up front and how it reports steps it could not checkpoint.

Kept apart from ``dstt.training.session`` (the capture lifecycle) so that module stays about the
session's lifecycle, flights and resume (its per-step hooks are ``dstt.training.steps``).
``check_optimizer`` runs when a session is built: a mismatch between the model and its
optimizer is a user mistake that would otherwise surface only at resume, as silently lost
optimizer state. Rejected alternative: checking at the first optimizer step — by then the user
has paid for a step and the error points at the training loop, not the setup."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from dstt.errors import CaptureError, ConfigError, DsttWarning

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from dstt.engine.capture.flight import Flight

__all__ = ["capture_error", "check_optimizer", "warn_skipped"]


def check_optimizer(
    model: torch.nn.Module, optimizers: Mapping[str, torch.optim.Optimizer]
) -> None:
    """Refuse optimizers whose state a resume would lose: ones that together hold none of the
    model's trainable parameters, or parameters the model does not have (``ConfigError``).
    Trainable parameters left out of every optimizer warn (``DsttWarning``): they are captured
    and restored, but nothing updates them. Frozen ones (``requires_grad=False``) are fine."""
    in_model = {id(p): name for name, p in model.named_parameters()}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    in_opt = [p for opt in optimizers.values() for g in opt.param_groups for p in g["params"]]
    foreign = [p for p in in_opt if id(p) not in in_model]
    if foreign:
        shapes = ", ".join(str(tuple(p.shape)) for p in foreign[:3])
        raise ConfigError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not the model's "
            f"(shapes {shapes}{', ...' if len(foreign) > 3 else ''}); dstt names optimizer "
            "state by the model's parameter names, so it could not restore it. Build the "
            "optimizer from this model's parameters (model.parameters()), or pass the model "
            "that owns them"
        )
    held = {id(p) for p in in_opt}
    if trainable and not held & trainable:
        raise ConfigError(
            f"the optimizer holds none of the model's {len(trainable)} trainable parameters, "
            "so no optimizer state would be captured and a resume would lose it. Pass the "
            "optimizer that trains this model (torch.optim.AdamW(model.parameters(), ...))"
        )
    left_out = [in_model[i] for i in in_model if i in trainable and i not in held]
    if left_out:
        names = ", ".join(left_out[:5]) + (
            f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        )
        warnings.warn(
            f"dstt: {len(left_out)} trainable parameter(s) are not in the optimizer: {names}. "
            "They are captured and restored, but no optimizer updates them; freeze them "
            "(requires_grad_(False)) if that is meant, or add them to the optimizer",
            DsttWarning,
            stacklevel=4,
        )


def capture_error(failed: list[Flight]) -> CaptureError:
    steps = ", ".join(str(f.step) for f in failed)
    err = failed[0].error
    if isinstance(err, CaptureError):
        err.add_note(f"dstt: steps not checkpointed: {steps}")
        return err
    out = CaptureError(
        f"step{'s' if len(failed) > 1 else ''} {steps} could not be checkpointed: "
        f"{type(err).__name__}: {err}. Earlier committed steps are intact. {_remedy(err)}, "
        "or pass error_policy='skip' to keep training without them."
    )
    out.__cause__ = err
    return out


def _remedy(err: BaseException | None) -> str:
    """What to do about the cause: free space only where the cause is the disk."""
    import errno

    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "Free disk space (or raise the file size limit)"
    if isinstance(err, OSError):
        return "Fix the storage problem named above"
    return "Fix the cause named above (its traceback is chained below)"


def warn_skipped(f: Flight, *, continuing: bool = True) -> None:
    tail = "; training continues" if continuing else ""
    warnings.warn(
        f"dstt: step {f.step} was not checkpointed ({type(f.error).__name__}: {f.error}){tail}",
        RuntimeWarning,
        stacklevel=3,
    )
