"""``DsttCallback`` for the Hugging Face ``Trainer``: every optimizer step captured by a Session.

A thin adapter over :class:`dstt.Session`, not a second capture path: ``on_train_begin``
unwraps the Trainer's optimizer and scheduler and starts a Session, whose step hooks capture
each optimizer step; ``on_step_end`` ends the iteration, ``on_log`` files the logged values
under the step just taken, ``on_train_end`` closes. Resume goes through the Trainer's own
machinery: ``cb.resume_from()`` writes a small folder in its checkpoint layout. Data
attribution taps the train loader's batch sampler (:mod:`._attribution`); the registered
``ReplayKit`` replays a step with the Trainer's own methods. Rejected: a full Trainer
checkpoint (a second copy of the largest state), setting ``state.global_step`` from a
callback (too late for the data skip), a replay loss re-deriving the Trainer's scaling
(drifts with every release). Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import warnings
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from dstt import schema
from dstt.engine.tensors._convert import from_plain
from dstt.errors import ConfigError, DsttWarning, NotARunError
from dstt.inspect.replay import ReplayKit, register_replay_kit
from dstt.store._internal import Batch, Repository, read_skips
from dstt.training import Session, open_session

from ._attribution import StepRecorder, attach, file_ranks
from ._common import (
    PROGRESS_FIELDS,
    numeric_metrics,
    refuse_whole_batches,
    session_options,
    unwrap_optimizer,
    unwrap_scheduler,
)

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = ["DsttCallback"]


class _Progress:
    """The ``TrainerState`` fields a resume needs, captured at the end of each iteration."""

    def __init__(self) -> None:
        self.state: TrainerState | None = None

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        return {} if s is None else {k: getattr(s, k) for k in PROGRESS_FIELDS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to do: the Trainer restores its progress from ``resume_from()``'s folder."""


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
        every: int | Literal["auto"] = 1,
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
        self._recorder: StepRecorder | None = None  # the train loader's batch sampler tap
        self._micro = 0  # micro-batches of the optimizer step under way, less one

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
        skipped = read_skips(reader.storage, reader.timelines, reader.ref().name).batches
        refuse_whole_batches(reader, skipped, _TRAINER, _REPLAY)
        rank = int(self._args.process_index)
        progress = _rank_object(reader, head, f"{schema.EXTRA_OBJECT}/transformers", rank) or {}
        rng = from_plain(_rank_object(reader, head, schema.RNG_OBJECT, rank))
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
        try:
            self._attach(kwargs.get("train_dataloader"), args, state)
        except BaseException as e:
            self._close(_TrainerError("the training data cannot be recorded"))
            raise e from None

    def _attach(self, loader: Any, args: TrainingArguments, state: TrainerState) -> None:
        """Record the indices of every batch the Trainer draws (and drop the samples this
        timeline skips) through its loader's batch sampler (:mod:`._attribution`)."""
        s = self.session
        assert s is not None
        skips = s._skips  # noqa: SLF001 - the timeline's skip set, read at the restore
        self._micro = 0
        self._recorder = rec = attach(loader, skips.samples) if loader is not None else None
        if rec is None:
            if skips:
                raise ConfigError(
                    f"run {self.run!r} resumes a timeline that skips samples "
                    f"{sorted(skips.samples)[:8]}, but the Trainer's loader does not fetch "
                    "batches by sample index (an IterableDataset, or a loader without a batch "
                    "sampler), so they cannot be left out; train on a map-style dataset, or "
                    "resume the timeline before the rollback"
                )
            return
        if skips.batches:
            assert s.repo is not None  # started
            refuse_whole_batches(s.repo.reader(), skips.batches, _TRAINER, _REPLAY)
        if state.global_step and not args.ignore_data_skip:
            # the Trainer skips the batches the resumed epoch had consumed (it counts them
            # from the global step, as here); the recorder sees them go by: forget them
            n, accum = len(loader), args.gradient_accumulation_steps
            per_epoch = max(n // accum + int(n % accum > 0), 1)
            rec.discard((state.global_step % per_epoch) * accum)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.session is not None:  # the iteration ended; the scheduler has stepped
            self._file_batches(self.session)
            self.session._at_boundary()  # noqa: SLF001 - the callback drives the step hooks

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._micro += 1  # a micro-batch that did not end its optimizer step

    def _file_batches(self, s: Session) -> None:
        """File the index lists of the step just taken (every rank's) under it."""
        n, self._micro = self._micro + 1, 0
        if self._recorder is not None:
            file_ranks(s, s.step, [Batch(indices=tuple(ix)) for ix in self._recorder.take(n)])

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
        if self.every == "auto" and "loss" in values:
            # the Trainer logs the sum of the step's training_step losses only when it logs
            # every step; an average over several steps is no light step's fingerprint
            strategy = getattr(args.logging_strategy, "value", args.logging_strategy)
            per_step = args.logging_steps == 1 and strategy == "steps"
            s._fingerprint(s.step, float(values["loss"]) if per_step else None)  # noqa: SLF001 - the callback files the step's loss

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


_TRAINER, _REPLAY = "the Trainer", "run.replay(k, trainer=trainer)"


def _rank_object(reader: Any, head: Any, name: str, rank: int) -> Any:
    """This rank's copy of a per-rank object (``<name>/r<rank>`` under several ranks), else
    the one-process copy or rank 0's (a run resumed on more processes than wrote it)."""
    for candidate in (f"{name}/r{rank}", name, f"{name}/r0"):
        if candidate in head.objects:
            return reader.read_object(head, candidate, trusted=True)
    return None


def _trainer_rng(rng: Mapping[str, Any], args: TrainingArguments) -> dict[str, Any]:
    """dstt's RNG object in the layout of the Trainer's ``rng_state.pth``."""
    py, npst = rng["python"], rng["numpy"]
    out: dict[str, Any] = {
        "python": (py[0], tuple(py[1]), py[2]),
        "numpy": (npst[0], np.asarray(npst[1]), *npst[2:]),
        "cpu": torch.frombuffer(bytearray(rng["torch"]), dtype=torch.uint8),
    }
    if "cuda" in rng and torch.cuda.is_available():
        cuda = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in rng["cuda"]]
        out["cuda"] = cuda if args.world_size > 1 else cuda[torch.cuda.current_device()]
    return out


# -- replay (dstt.inspect.replay's seam) -------------------------------------------------------
class _TrainerStep:
    """One optimizer step of a ``transformers.Trainer``, as ``run.replay(k, trainer=...)``
    re-executes it: the Trainer's own collator, ``training_step`` and clipping.

    ``replay`` builds a step's micro-batches first (``make_batch``, once per micro-batch),
    then runs ``backward`` on each: the first ``backward`` takes the batches built so far as
    the step, because the Trainer scales the loss by what the whole step holds (the label
    tokens of every micro-batch: ``num_items_in_batch``; else the number of micro-batches).
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        if trainer.train_dataset is None:
            raise ConfigError(
                "replay rebuilds the step's batches from the Trainer's train_dataset: "
                "build the Trainer with the dataset it trained on"
            )
        if trainer.optimizer is None:  # a Trainer that has not trained: build them as train() does
            steps = trainer.state.max_steps or trainer.args.max_steps
            if steps <= 0:
                raise ConfigError(
                    "this Trainer has no optimizer yet and no max_steps to build its learning "
                    "rate schedule from: replay after trainer.train(), or set max_steps"
                )
            trainer.create_optimizer_and_scheduler(num_training_steps=steps)
        self.model: torch.nn.Module = trainer.model
        self.wrapped: torch.nn.Module = trainer.model_wrapped or trainer.model
        self.dataset, self.collate = _train_data(trainer)
        self._built: list[Any] = []  # batches make_batch built since the step's were taken
        self._step: list[Any] = []  # the micro-batches of the step being replayed
        self._done = 0  # how many of them went through backward
        self._items: Any = None  # the Trainer's num_items_in_batch for the step

    def make_batch(self, indices: Sequence[int]) -> Any:
        batch = self.collate([self.dataset[int(i)] for i in indices])
        self._built.append(batch)
        return batch

    def backward(self, batch: Any) -> torch.Tensor:
        tr = self.trainer
        if self._done == len(self._step):  # the first micro-batch of the step
            self._step, self._built, self._done = self._built, [], 0
            if not any(b is batch for b in self._step):
                self._step = [batch]
            self._items = tr._get_num_items_in_batch(self._step, tr.args.device)  # noqa: SLF001
            tr.current_gradient_accumulation_steps = len(self._step)
        self._done += 1
        tr.accelerator.gradient_state._set_sync_gradients(self._done == len(self._step))  # noqa: SLF001
        loss: torch.Tensor = tr.training_step(self.wrapped, batch, self._items)
        return loss.detach()

    def before_step(self) -> None:
        tr = self.trainer
        tr.accelerator.gradient_state._set_sync_gradients(True)  # noqa: SLF001
        if tr.args.max_grad_norm is not None and tr.args.max_grad_norm > 0:
            tr._clip_grad_norm(self.wrapped)  # noqa: SLF001 - the Trainer's own clipping

    def sample_loss(self, batch: Any) -> torch.Tensor:
        tr = self.trainer
        inputs = tr._prepare_inputs(batch)  # noqa: SLF001
        with tr.compute_loss_context_manager():
            loss: torch.Tensor = tr.compute_loss(self.wrapped, inputs)
        return loss


def _train_data(trainer: Any) -> tuple[Any, Any]:
    """The Trainer's train dataset and the collate function its train loader uses (unused
    columns removed, as ``get_train_dataloader`` does)."""
    dataset = trainer.train_dataset
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ConfigError(
            "replay rebuilds a step's batches from their sample indices, and an "
            "IterableDataset has none: pass replay(..., batches=[the step's batches])"
        )
    datasets = sys.modules.get("datasets")  # loaded wherever a datasets.Dataset exists
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")  # noqa: SLF001
        return dataset, trainer.data_collator
    collate = trainer._get_collator_with_removed_columns(  # noqa: SLF001
        trainer.data_collator, description="training"
    )
    return dataset, collate


def _is_trainer(x: object) -> bool:
    from transformers import Trainer

    return isinstance(x, Trainer)


def _replay_kit(trainer: object, module: object | None = None) -> ReplayKit:
    if module is not None:
        raise ConfigError(
            "module= is for Lightning; a transformers.Trainer replays its own model "
            "(run.replay(k, trainer=trainer))"
        )
    t: Any = trainer
    step = _TrainerStep(t)
    return ReplayKit(
        model=step.model,
        optimizer=unwrap_optimizer(t.optimizer),
        scheduler=unwrap_scheduler(t.lr_scheduler),
        make_batch=step.make_batch,
        backward=step.backward,
        before_step=step.before_step,
        sample_loss=step.sample_loss,
    )


register_replay_kit(_is_trainer, _replay_kit)
