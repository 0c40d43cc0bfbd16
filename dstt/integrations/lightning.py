"""``DsttCallback`` for ``lightning.Trainer``: every optimizer step captured by a Session.

Design: as for the Hugging Face Trainer, a thin adapter over :class:`dstt.Session`. At
``on_fit_start`` Lightning has configured the optimizer and scheduler; the callback starts a
Session on the LightningModule, ``trainer.optimizers[0]`` and its scheduler, and the Session's
optimizer step hooks capture each optimizer step (once per ``accumulate_grad_batches``
batches, manual optimization included). ``on_train_batch_end`` ends the iteration and files the
values ``self.log`` produced for that batch (step-level ones) under the step just taken;
epoch-level and validation values are filed under the step at which Lightning computed them.

Resume uses Lightning's own restore path without a ``.ckpt`` file: each commit carries the fit
loop's state (``trainer.fit_loop.state_dict()``, taken at ``on_train_batch_end`` — the moment a
``ModelCheckpoint`` saves), and ``resume=True`` restores model, optimizer, scheduler and RNG
through the Session, then hands the loop state to ``fit_loop.load_state_dict`` exactly as
``trainer.fit(ckpt_path=...)`` does. Lightning therefore continues its global step and epoch,
and resumes the data as its own checkpoints do: bit-exact at an epoch boundary or with a
stateful train loader (``state_dict``/``load_state_dict``, e.g. torchdata's
``StatefulDataLoader``); a plain loader resumed mid-epoch restarts that epoch's batches
(Lightning warns). Rejected alternative: writing a Lightning ``.ckpt`` from the run — a second
copy of the model and optimizer, in a layout private to each Lightning version.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from dstt.errors import ConfigError
from dstt.training import Session, open_session

from ._common import numeric_metrics, session_options

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping

    from dstt.store import Repository

__all__ = ["DsttCallback"]


class _Loops:
    """The fit loop's state, kept with each commit (``extra/lightning`` in the run)."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        if t is None:
            return {}
        return {
            "fit_loop": t.fit_loop.state_dict(),
            "epoch_end": t.fit_loop.epoch_loop.batch_progress.current.ready
            >= t.num_training_batches,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.restored = dict(state)


class DsttCallback(Callback):
    """Capture every ``every``-th optimizer step of a ``lightning.Trainer`` fit into ``run``.

    ``Trainer(callbacks=[DsttCallback(run="runs/x")])``; ``resume=True`` continues the run's
    latest commit (a new run starts from scratch) — leave ``fit(ckpt_path=...)`` unset. Other
    keyword arguments go to :func:`dstt.session`. ``cb.session`` is the open Session.
    """

    def __init__(
        self,
        run: str | os.PathLike[str] | Repository,
        *,
        every: int = 1,
        resume: bool = False,
        **options: Any,
    ) -> None:
        self.options = session_options(run, every=every, resume=resume, options=options)
        self.run, self.every, self.resume = run, self.options.every, self.options.resume
        self.session: Session | None = None
        self._loops = _Loops()
        self._rng: tuple[Any, ...] | None = None  # restored RNG, re-applied mid-epoch

    # -- fit --------------------------------------------------------------------------------
    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self.resume:  # fit(ckpt_path=...) is restoring, before anything else is touched
            raise ConfigError(
                "DsttCallback(resume=True) restores the run itself; do not also "
                f"pass fit(ckpt_path={trainer.ckpt_path!r})"
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.session is not None:
            self._close(RuntimeError("a previous fit stopped without ending"))
        if len(trainer.optimizers) != 1:
            raise ConfigError(
                f"DsttCallback captures one optimizer; configure_optimizers "
                f"returned {len(trainer.optimizers)}"
            )
        if self.resume and trainer.ckpt_path is not None:
            raise ConfigError(
                "DsttCallback(resume=True) restores the run itself; do not also "
                f"pass fit(ckpt_path={trainer.ckpt_path!r})"
            )
        configs = trainer.lr_scheduler_configs
        scheduler = configs[0].scheduler if len(configs) == 1 else None
        if len(configs) > 1:
            raise ConfigError(f"DsttCallback captures one LR scheduler, not {len(configs)}")
        self._loops.trainer = trainer
        s = open_session(
            pl_module,
            trainer.optimizers[0],
            self.options,
            scheduler=scheduler,
            extra_state={"lightning": self._loops},
        )
        s.start()
        self.session = s
        restored = self._loops.restored
        if s.step and restored and restored.get("fit_loop"):
            trainer.fit_loop.load_state_dict(restored["fit_loop"])
            if not restored.get("epoch_end"):  # the loader is re-iterated before the next
                self._rng = _get_rng()  # batch: that must not move the RNG

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:
            _set_rng(self._rng)
            self._rng = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        s = self.session
        if s is None:
            return
        # after the optimizer and scheduler stepped: end of the iteration (the Trainer's loop
        # stands in for the tracked loader that calls this hook)
        s._at_boundary()  # noqa: SLF001 - the callback drives the session's step hooks
        if s.step:
            values = numeric_metrics(_step_metrics(trainer))
            if values:
                s.log(step=s.step, **values)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._file_epoch_metrics(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._file_epoch_metrics(trainer)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._close(None)

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None:
        self._close(exception)

    def close(self) -> None:
        """Commit the last step and release the run (``on_fit_end`` does it)."""
        self._close(None)

    # -- helpers ----------------------------------------------------------------------------
    def _file_epoch_metrics(self, trainer: Trainer) -> None:
        s = self.session
        if s is None or not s.step or trainer.sanity_checking:
            return
        values = numeric_metrics(
            {k: v for k, v in trainer.callback_metrics.items() if not k.endswith("_step")}
        )
        if values:
            s.log(step=s.step, **values)

    def _close(self, exc: BaseException | None) -> None:
        s, self.session = self.session, None
        self._rng = None
        if s is not None:
            s.close(exc)


def _step_metrics(trainer: Trainer) -> Mapping[str, Any]:
    """The values ``self.log`` gave this batch at step level (Lightning's own selection for
    its loggers, whatever ``log_every_n_steps`` says)."""
    results = getattr(trainer.fit_loop.epoch_loop, "_results", None)
    if results is None:
        return {}
    metrics: Mapping[str, Any] = results.metrics(True)["callback"]
    return metrics


def _get_rng() -> tuple[Any, ...]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, np.random.get_state(), random.getstate()


def _set_rng(state: tuple[Any, ...]) -> None:
    cpu, cuda, npst, py = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    np.random.set_state(npst)
    random.setstate(py)
