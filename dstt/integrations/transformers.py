"""``DsttCallback`` for the Hugging Face ``Trainer``: every optimizer step captured by a Session.

Design: the callback is a thin adapter over :class:`dstt.Session`, not a second capture path.
At ``on_train_begin`` the Trainer has created its optimizer and scheduler (and accelerate has
wrapped them); the callback unwraps them and starts a Session on the model, the torch
optimizer and the scheduler. The Session's optimizer step hooks then capture each optimizer
step exactly as in a hand-written loop — once per optimizer step, so gradient accumulation
commits once per ``gradient_accumulation_steps`` micro-batches. ``on_step_end`` (after the
scheduler stepped) marks the end of the iteration, ``on_log`` files the Trainer's logged
values (``loss``, ``learning_rate``, ``grad_norm``, eval metrics) with ``s.log(step=...)``
under the step just taken, and ``on_train_end`` closes the Session (commits the last step).

Resume goes through the Trainer's own machinery, because only the Trainer knows how to skip
the batches a step consumed (``skip_first_batches`` in the resumed epoch) and when to restore
the RNG (after that skip): ``cb.resume_from()`` writes a small directory in the Trainer's
checkpoint layout — ``trainer_state.json`` (global step, epoch, tokens seen, from the run's
head commit), ``rng_state.pth`` (the head commit's RNG states) and the weights file the Trainer
insists on loading — and ``trainer.train(resume_from_checkpoint=cb.resume_from())`` then
continues. When training begins, the Session (``resume=True``) restores the committed model,
optimizer and scheduler over what the Trainer loaded. Rejected alternatives: exporting a full
Trainer checkpoint (``optimizer.pt``, ``scheduler.pt``: a second copy of the largest state,
which the Session restores bit-exactly anyway), and setting ``state.global_step`` from a
callback (too late: the Trainer decides the data skip before ``on_train_begin``).

The Trainer has no exception hook: if ``train()`` raises, the Session is closed at the next
``train()`` or at interpreter exit (committing only complete steps), or by ``cb.close()``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dstt.engine._convert import from_plain
from dstt.errors import ConfigError, DsttWarning, NotARunError
from dstt.store import Repository
from dstt.training import Session, open_session

from ._common import (
    PROGRESS_FIELDS,
    numeric_metrics,
    session_options,
    unwrap_optimizer,
    unwrap_scheduler,
)

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["DsttCallback"]


class _Progress:
    """The ``TrainerState`` fields a resume needs, captured at the end of each iteration."""

    def __init__(self) -> None:
        self.state: TrainerState | None = None
        self.restored: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {} if s is None else {k: getattr(s, k) for k in PROGRESS_FIELDS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.restored = dict(state)


class _TrainerError(RuntimeError):
    """Marks a Session closed because the Trainer stopped without ``on_train_end``."""


class DsttCallback(TrainerCallback):
    """Capture every ``every``-th optimizer step of a ``transformers.Trainer`` into ``run``.

    ``Trainer(..., callbacks=[DsttCallback(run="runs/x")])``. ``resume=True`` continues the
    run's latest commit: pass ``trainer.train(resume_from_checkpoint=cb.resume_from())``
    (``None`` for a run with no commit yet, which starts from scratch). Other keyword
    arguments go to :func:`dstt.session` (``budget_bytes``, ``encoding``, ``copy``, ...).
    The open Session is ``cb.session`` while training runs.
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
        self._progress = _Progress()
        self._args: TrainingArguments | None = None
        self._model: torch.nn.Module | None = None
        self._pad: str | None = None
        self._warned_step = False

    # -- resume ----------------------------------------------------------------------------
    def resume_from(self) -> str | None:
        """A directory for ``trainer.train(resume_from_checkpoint=...)`` that continues the
        run's head commit, or ``None`` when the run has no commit yet (a fresh start).

        It holds ``trainer_state.json`` (the global step the Trainer skips data by),
        ``rng_state.pth`` (restored by the Trainer after that skip) and the model's current
        weights (the Trainer requires a weights file; the Session overwrites them with the
        committed step, with the optimizer and scheduler, when training begins). It is
        temporary: removed when training ends.
        """
        if not self.resume:
            raise ConfigError(
                "resume_from() continues a run: create the callback with "
                "DsttCallback(run=..., resume=True)"
            )
        if self._args is None or self._model is None:
            raise ConfigError(
                "pass the callback to the Trainer first: "
                "Trainer(..., callbacks=[cb]), then cb.resume_from()"
            )
        run = self.options.run
        if isinstance(run, Repository):
            repo = run
        else:
            try:
                repo = Repository.open(run)
            except NotARunError:
                return None  # a new run: nothing to resume, training starts from scratch
        reader = repo.reader()
        head = reader.head()
        if head is None:
            return None
        rank = int(self._args.process_index)
        progress = _rank_object(reader, head, "extra/transformers", rank) or {}
        rng = from_plain(_rank_object(reader, head, "rng", rank))
        self._remove_pad()
        pad = tempfile.mkdtemp(prefix=f"dstt-resume-{head.step}-")
        self._pad = pad
        args = self._args
        fields = {k: progress[k] for k in PROGRESS_FIELDS if progress.get(k) is not None}
        fields["global_step"] = head.step  # the commit's step is the truth
        fields.setdefault("train_batch_size", args.per_device_train_batch_size * max(1, args.n_gpu))
        steps: dict[str, Any] = {
            "logging_steps": args.logging_steps,
            "eval_steps": args.eval_steps,
            "save_steps": args.save_steps,
        }
        state = TrainerState(**steps, **fields)
        state.save_to_json(os.path.join(pad, "trainer_state.json"))
        # the Trainer loads rng_state_<rank>.pth under several processes, else rng_state.pth
        name = f"rng_state_{rank}.pth" if args.world_size > 1 else "rng_state.pth"
        torch.save(_trainer_rng(rng, args), os.path.join(pad, name))
        model: Any = self._model
        if hasattr(model, "save_pretrained") and args.world_size <= 1:
            model.save_pretrained(pad)
        else:  # save_pretrained writes on rank 0 only; every rank's Trainer loads this pad
            from safetensors.torch import save_model

            save_model(model, os.path.join(pad, "model.safetensors"))
        return pad

    # -- Trainer events ---------------------------------------------------------------------
    def on_init_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._args, self._model = args, kwargs.get("model")

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:  # an earlier train() raised: finish what it left
            self._close(_TrainerError("a previous Trainer.train() stopped without ending"))
        model, optimizer = kwargs.get("model"), kwargs.get("optimizer")
        if model is None or optimizer is None:
            raise ConfigError(
                "DsttCallback found no model or optimizer at on_train_begin; "
                "is it passed to Trainer(callbacks=[...])?"
            )
        self._args = args
        self._progress.state = state
        s = open_session(
            model,
            unwrap_optimizer(optimizer),
            self.options,
            scheduler=unwrap_scheduler(kwargs.get("lr_scheduler")),
            extra_state={"transformers": self._progress},
        )
        s.start()
        self.session = s
        atexit.register(self._at_exit)
        if s.step != state.global_step:
            k, g = s.step, state.global_step
            self._close(_TrainerError("step mismatch"))
            if g == 0:
                raise ConfigError(
                    f"run {self.run!r} is at step {k} but the Trainer starts at step 0: pass "
                    "trainer.train(resume_from_checkpoint=cb.resume_from()) so that it continues "
                    "its step count and skips the batches the run already consumed"
                )
            raise ConfigError(
                f"the Trainer resumes at step {g} but run {self.run!r} is at step {k}: resume "
                "with trainer.train(resume_from_checkpoint=cb.resume_from()), not from another "
                "checkpoint"
            )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:  # the iteration ended; the scheduler has stepped
            self.session._at_boundary()  # noqa: SLF001 - the callback drives the step hooks

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        s = self.session
        if s is None or not logs:
            return
        values = numeric_metrics(logs)
        if not values:
            return
        if s.step == 0:  # logged before the first step (eval_on_start): joins step 1
            s.log(**values)
            return
        if state.global_step != s.step and not self._warned_step:
            self._warned_step = True
            warnings.warn(
                f"dstt: the Trainer is at step {state.global_step} but "
                f"{s.step} optimizer steps were taken (a skipped fp16 step?); its "
                "logs are filed under the optimizer step",
                DsttWarning,
                stacklevel=2,
            )
        s.log(step=s.step, **values)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._close(None)

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Release the run now. ``on_train_end`` does it after a normal end; call it in a
        ``finally`` around ``trainer.train()`` when training may raise: training did not end,
        so the last step is committed only if its iteration had finished (as a session does
        on an exception)."""
        if self.session is not None:
            self._close(_TrainerError("DsttCallback.close() before the Trainer's on_train_end"))

    def _close(self, exc: BaseException | None) -> None:
        s, self.session = self.session, None
        atexit.unregister(self._at_exit)
        try:
            if s is not None:
                s.close(exc)
        finally:
            self._remove_pad()

    def _at_exit(self) -> None:
        self._close(_TrainerError("the interpreter exited during Trainer.train()"))

    def _remove_pad(self) -> None:
        pad, self._pad = self._pad, None
        if pad is not None:
            shutil.rmtree(pad, ignore_errors=True)


def _rank_object(reader: Any, head: Any, name: str, rank: int) -> Any:
    """This rank's copy of a per-rank object (``<name>/r<rank>`` under several ranks), else
    the one-process copy or rank 0's (a run resumed on more processes than wrote it)."""
    for candidate in (f"{name}/r{rank}", name, f"{name}/r0"):
        if candidate in head.objects:
            return reader.read_object(head, candidate, trusted=True)
    return None


def _trainer_rng(rng: Mapping[str, Any], args: TrainingArguments) -> dict[str, Any]:
    """dstt's RNG object in the layout of the Trainer's ``rng_state.pth``."""
    py = rng["python"]
    npst = rng["numpy"]
    out: dict[str, Any] = {
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": (npst[0], np.asarray(npst[1]), *npst[2:]),
        "cpu": torch.frombuffer(bytearray(rng["torch"]), dtype=torch.uint8),
    }
    if "cuda" in rng and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in rng["cuda"]]
        out["cuda"] = cuda if args.world_size > 1 else cuda[torch.cuda.current_device()]
    return out
