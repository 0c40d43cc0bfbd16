"""``DsttCallback`` for ``lightning.Trainer``: every optimizer step captured by a Session.

A thin adapter over :class:`dstt.Session`, as for the Hugging Face Trainer: ``on_fit_start``
starts a Session on the LightningModule, ``trainer.optimizers[0]`` and its scheduler;
``on_train_batch_end`` ends the iteration and files ``self.log``'s step-level values. Resume
restores through the Session, then hands the fit loop's state kept with each commit to
``fit_loop.load_state_dict``; the train loader gets :mod:`._attribution`'s recorder where the
strategy hands it back; importing registers the Lightning ``ReplayKit``. Rejected: a ``.ckpt``
written from the run (a second copy, in a layout private to each Lightning version);
wrapping Lightning's data fetcher (private, re-created every epoch); driving its
automatic-optimization loop for replay (private, and it steps the scheduler and counters too).
Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from dstt.engine.capture.light import step_loss
from dstt.engine.state.torch_state import get_rng, set_rng
from dstt.errors import ConfigError, ReplayError
from dstt.inspect.replay import ReplayKit, register_replay_kit
from dstt.store._internal import Batch, SkipSet
from dstt.training import Session, open_session
from dstt.training.data import Passthrough, fingerprint

from ._attribution import StepRecorder, attach, file_ranks
from ._common import numeric_metrics, refuse_whole_batches, session_options

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Sequence

    from dstt.store._internal import Repository

__all__ = ["DsttCallback", "replay_kit"]


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
        every: int | Literal["auto"] = 1,
        resume: bool = False,
        **options: Any,
    ) -> None:
        self.options = session_options(run, every=every, resume=resume, options=options)
        self.run, self.every, self.resume = run, self.options.every, self.options.resume
        self.session: Session | None = None
        self._micro: list[float] | None = []  # the step's micro-batch losses (every="auto")
        self._loops = _Loops()
        self._rng: dict[str, Any] | None = None  # restored RNG, re-applied mid-epoch
        self._data = _TrainData()  # the train loader's recorder, and what it still has to do

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
        skips: SkipSet = s._skips  # noqa: SLF001 - the timeline's skip set, read at the restore
        self._data = _TrainData(skips)
        if s.step:
            assert s.repo is not None
            refuse_whole_batches(s.repo.reader(), skips.batches, "Lightning", _REPLAY)
        restored = self._loops.restored
        if s.step and restored and restored.get("fit_loop"):
            trainer.fit_loop.load_state_dict(restored["fit_loop"])
            if not restored.get("epoch_end"):  # the loader is re-iterated before the next
                self._rng = get_rng()  # batch: that must not move the RNG
                # the batches of the restored epoch already trained on: drawn, not fetched
                self._data.forward = int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        self._data.wrap(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.session is not None:
            self._data.check(self.run)

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._rng is not None:
            set_rng(self._rng)
            self._rng = None
        s = self.session
        if s is not None:  # this batch feeds the next optimizer step
            self._data.drawn(s.step + 1, batch)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        s = self.session
        if s is None:
            return
        step = self._data.pending_step or s.step  # the step this batch fed (accumulating:
        self._data.file(s)  # the one not taken yet, which the step's last batch files)
        if self.every == "auto":
            self._loss_of(s, step, outputs)
        # after the optimizer and scheduler stepped: end of the iteration (the Trainer's loop
        # stands in for the tracked loader that calls this hook)
        s._at_boundary()  # noqa: SLF001 - the callback drives the session's step hooks
        if step:
            values = numeric_metrics(_step_metrics(trainer))
            if values:
                s.log(step=step, **values)

    def _loss_of(self, s: Session, step: int, outputs: Any) -> None:
        """``every="auto"``: a step's loss for its light record, from what its micro-batches'
        ``training_step`` returned (Lightning's closure loss, divided by the accumulation,
        as a rebuild recomputes it); None where one returned no loss tensor."""
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if self._micro is not None:
            if isinstance(loss, torch.Tensor) and loss.numel() == 1:
                self._micro.append(float(loss.detach().float().mean()))
            else:
                self._micro = None
        if step and s.step >= step:  # the step is taken: its last micro-batch
            s._fingerprint(step, None if not self._micro else step_loss(self._micro))  # noqa: SLF001 - the callback files the step's loss
            self._micro = []

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
        self._data.unwrap()
        if s is not None:
            s.close(exc)


_REPLAY = "run.replay(k, trainer=trainer, module=module)"


class _FastForward(Passthrough):
    """Below the recorder, in place of the batch sampler: each new pass (epoch) clears the
    recorder's queue (a stopped fit may have left a prefetched list in it), and the first
    pass after a mid-epoch resume draws, without fetching, the index lists the restored epoch
    had already trained on."""

    def __init__(self, inner: Any, forward: int) -> None:
        super().__init__(inner)
        self.forward = forward
        self.recorder: StepRecorder | None = None

    def __iter__(self) -> Iterator[Any]:
        if self.recorder is not None:
            self.recorder.queue.clear()
        it = iter(self.inner)
        n, self.forward = self.forward, 0
        for _ in range(n):
            if next(it, _END) is _END:
                return
        yield from it


_END = object()
# what Lightning warns when it restarts a plain loader mid-epoch; _FastForward resumes it
_RESTART_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


class _TrainData:
    """The train loader's side of the callback: the recorder on it (installed where the
    strategy hands the processed loader back), each step's fingerprints until the step is
    taken, and the skip set to honour (see the module docstring)."""

    def __init__(self, skips: SkipSet | None = None) -> None:
        self.skips = skips or SkipSet()
        self.forward = 0  # index lists to draw unfetched on the next pass (a mid-epoch resume)
        self.loaders: list[Any] = []  # the train loaders Lightning processed in this fit
        self.recorder: StepRecorder | None = None
        self.pending: list[Batch] = []
        self.pending_step = 0
        self._unwrap: Callable[[], None] | None = None
        self._quiet: warnings.catch_warnings[None] | None = None

    def wrap(self, trainer: Trainer) -> None:
        """Wrap ``trainer.strategy.process_dataloader`` for this fit: the train loader it
        returns gets the recorder before the fit loop iterates it."""
        strategy = trainer.strategy
        own = vars(strategy)
        before = own.get("process_dataloader")
        original = strategy.process_dataloader

        def process(dataloader: object) -> object:
            out = original(dataloader)
            if trainer.training:  # the train loader (validation loaders pass through)
                self.tap(out)
            return out

        own["process_dataloader"] = process

        def unwrap() -> None:
            if before is None:
                own.pop("process_dataloader", None)
            else:
                own["process_dataloader"] = before

        self._unwrap = unwrap

    def unwrap(self) -> None:
        self.loud()
        undo, self._unwrap = self._unwrap, None
        if undo is not None:
            undo()

    def tap(self, loader: Any) -> None:
        self.loaders.append(loader)
        base = loader.batch_sampler if isinstance(loader, torch.utils.data.DataLoader) else None
        theirs = isinstance(base, StepRecorder) and not isinstance(base.inner, _FastForward)
        if base is None or theirs or not _by_index(loader):
            self.recorder = attach(loader, self.skips.samples)
            return
        below = base.inner if isinstance(base, StepRecorder) else None  # an earlier fit's
        if not isinstance(below, _FastForward):
            below = _FastForward(base, 0)
            object.__setattr__(loader, "batch_sampler", below)  # DataLoader refuses setattr
        stateful = callable(getattr(loader, "state_dict", None))  # Lightning restores it
        below.forward = 0 if stateful else self.forward
        if below.forward:  # Lightning warns that this loader restarts the epoch: not so here
            self._quiet = warnings.catch_warnings()
            self._quiet.__enter__()
            warnings.filterwarnings("ignore", message=_RESTART_WARNING)
        rec = attach(loader, self.skips.samples)
        below.recorder = rec
        self.recorder = rec

    def check(self, run: object) -> None:
        """At the start of training: a skip set needs exactly one recorded train loader."""
        if len(self.loaders) != 1:
            self.recorder = None  # several loaders (or none seen): fingerprint by hash
        if self.skips.samples and self.recorder is None:
            raise ConfigError(
                f"run {run!r} resumes a timeline that skips samples "
                f"{sorted(self.skips.samples)[:8]}, but Lightning's train loader does not "
                "fetch batches by sample index (an IterableDataset, a custom iterable, several "
                "train loaders, or a loader this fit did not set up), so they cannot be left "
                "out; train on one DataLoader over a map-style dataset, or resume the "
                "timeline before the rollback"
            )

    def loud(self) -> None:
        """Lift the filter of Lightning's restart warning (the epoch has restarted)."""
        quiet, self._quiet = self._quiet, None
        if quiet is not None:
            quiet.__exit__(None, None, None)

    def drawn(self, step: int, batch: Any) -> None:
        """A batch Lightning is about to train on, for optimizer step ``step``."""
        self.loud()
        if self.pending and step != self.pending_step:
            self.pending = []  # a step that never came (the fit stopped): not filed
        self.pending_step = step
        rec = self.recorder
        lists = rec.take(1) if rec is not None else []
        self.pending.append(Batch(indices=tuple(lists[0])) if lists else fingerprint(batch))

    def file(self, s: Session) -> None:
        """After a batch: once its optimizer step is taken, file the step's fingerprints
        (every rank's, rank-major) under it."""
        if not self.pending or s.step < self.pending_step:
            return  # accumulating: the step is not taken yet
        mine, self.pending = self.pending, []
        file_ranks(s, self.pending_step, mine)


def _by_index(loader: torch.utils.data.DataLoader[Any]) -> bool:
    """Whether the loader fetches its batches by sample index, in order."""
    return not isinstance(loader.dataset, torch.utils.data.IterableDataset) and (
        getattr(loader, "in_order", True) is not False
    )


def _step_metrics(trainer: Trainer) -> Mapping[str, Any]:
    """The values ``self.log`` gave this batch at step level (Lightning's own selection for
    its loggers, whatever ``log_every_n_steps`` says)."""
    results = getattr(trainer.fit_loop.epoch_loop, "_results", None)
    return {} if results is None else dict(results.metrics(True)["callback"])


# -- replay ----------------------------------------------------------------------------------
def replay_kit(trainer: object, module: object | None) -> ReplayKit:
    """The :class:`~dstt.inspect.replay.ReplayKit` of a ``lightning.Trainer`` and its
    LightningModule (see the module docstring); registered for ``run.replay(trainer=...)``."""
    if not isinstance(trainer, Trainer):
        raise ConfigError(f"trainer= must be a lightning.Trainer, not {type(trainer).__name__}")
    if not isinstance(module, LightningModule):
        raise ConfigError(
            "run.replay(k, trainer=<lightning.Trainer>) needs module=<the LightningModule> "
            f"(built as the training script built it), not {type(module).__name__}"
        )
    if not module.automatic_optimization:
        raise ReplayError(
            f"{type(module).__name__} uses manual optimization: its training_step runs backward "
            "and optimizer.step() itself, which a replay cannot split; replay it as a plain "
            "loop: run.replay(k, module, optimizer, loss_fn=<the loss training_step computes>, "
            "dataset=...)"
        )
    if trainer.lightning_module is not module:
        trainer.strategy.connect(module)
    module.trainer = trainer
    optimizer, scheduler = _replay_optimizer(trainer, module)
    accum = int(trainer.accumulate_grad_batches)
    plugin = trainer.precision_plugin

    def loss_of(batch: Any, batch_idx: int) -> torch.Tensor:
        with _replaying(trainer, module), plugin.train_step_context():
            out = module.training_step(batch, batch_idx)
        loss = out.get("loss") if isinstance(out, dict) else out
        if not isinstance(loss, torch.Tensor):
            raise ReplayError(
                f"{type(module).__name__}.training_step returned {type(out).__name__} for a "
                "replayed batch: it must return the loss (a tensor, or a dict with 'loss')"
            )
        return loss

    micro = [0]  # the micro-batch's position in the step, as training_step's batch_idx

    def backward(batch: Any) -> torch.Tensor:
        loss = loss_of(batch, micro[0]) / accum  # Lightning's closure divides, even by 1
        micro[0] += 1
        with _replaying(trainer, module):
            scaled = plugin.pre_backward(loss, module)
            plugin.backward(scaled, module, optimizer)
            plugin.post_backward(scaled, module)
        return loss.detach()

    def before_step() -> None:
        micro[0] = 0
        with _replaying(trainer, module):
            plugin._after_closure(module, optimizer)  # noqa: SLF001 - Lightning's own: hooks, clipping

    def sample_loss(batch: Any) -> torch.Tensor:
        return loss_of(batch, 0)

    return ReplayKit(
        model=module,
        optimizer=optimizer,
        scheduler=scheduler,
        make_batch=_replay_batches(trainer, module),
        backward=backward,
        before_step=before_step,
        sample_loss=sample_loss,
    )


def _replay_optimizer(trainer: Trainer, module: LightningModule) -> tuple[Any, Any]:
    """The trainer's optimizer and scheduler when they update ``module`` (a fitted trainer),
    else the ones ``configure_optimizers`` builds."""
    mine = {id(p) for p in module.parameters()}
    opts, configs = list(trainer.optimizers), list(trainer.lr_scheduler_configs)
    if not opts or any(id(p) not in mine for g in opts[0].param_groups for p in g["params"]):
        from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

        opts, configs = _init_optimizers_and_lr_schedulers(module)
        trainer.strategy.optimizers, trainer.strategy.lr_scheduler_configs = opts, configs
    if len(opts) != 1 or len(configs) > 1:
        raise ConfigError(
            f"the Lightning replay handles one optimizer and at most one LR scheduler, as "
            f"DsttCallback captures them; configure_optimizers gave {len(opts)} and {len(configs)}"
        )
    return opts[0], configs[0].scheduler if configs else None


def _replay_batches(
    trainer: Trainer, module: LightningModule
) -> Callable[[Sequence[int]], Any] | None:
    """Indices -> the batch as Lightning fed it: the train loader's dataset and collate
    function, then Lightning's batch transfer. None when no train loader is found (pass
    ``dataset=``)."""
    loader: Any = trainer.train_dataloader
    if loader is None:
        datamodule = getattr(trainer, "datamodule", None)
        source = datamodule if datamodule is not None else module
        try:
            loader = source.train_dataloader()
        except Exception:  # not defined, or needs a fit: dataset= then
            loader = None
    if not isinstance(loader, torch.utils.data.DataLoader) or isinstance(
        loader.dataset, torch.utils.data.IterableDataset
    ):
        return None
    dataset, collate = loader.dataset, loader.collate_fn

    def make(indices: Sequence[int]) -> Any:
        batch = collate([dataset[int(i)] for i in indices])
        with _replaying(trainer, module):
            batch = trainer.precision_plugin.convert_input(batch)
            batch = module._on_before_batch_transfer(batch, dataloader_idx=0)  # noqa: SLF001
            return trainer.strategy.batch_to_device(batch, dataloader_idx=0)

    return make


@contextmanager
def _replaying(trainer: Trainer, module: LightningModule) -> Iterator[None]:
    """The trainer in its training state for Lightning's hooks, ``self.log`` silenced."""
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    state = trainer.state
    saved = (state.fn, state.stage)
    state.fn, state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    vars(module)["log"] = _no_log
    try:
        yield
    finally:
        vars(module).pop("log", None)
        state.fn, state.stage = saved


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` during a replay: the replayed step files no metrics."""


register_replay_kit(lambda t: isinstance(t, Trainer), replay_kit)
