"""``dstt.session(...)``: the one entry point; picks the session class for what it is given.

A plain ``torch.nn.Module`` and optimizer get a :class:`~dstt.training.session.Session`; the
same on one rank of several (an initialized process group: DDP, FSDP2, tensor parallel), or a
model holding DTensors, a :class:`~dstt.training.distributed.DistributedSession`; a DeepSpeed
engine a :class:`~dstt.training.deepspeed.DeepSpeedSession`. The classes live in their own
modules and this one imports them, so imports flow one way (``factory`` → ``deepspeed`` →
``distributed`` → ``session``); the multi-rank ones only when picked, so a plain session's
start imports none of their machinery (ranks, sharding, ZeRO).
Rejected alternative: the factory next to ``Session`` with a function-level import of the
DeepSpeed subclass — a cycle, hidden from import-time checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from dstt.engine.tensors.dtensors import is_dtensor

from .options import (
    DEFAULT_BUDGET,
    DEFAULT_MAX_GAP,
    DEFAULT_RANK_TIMEOUT,
    DEFAULT_START_TIMEOUT,
    CopyMode,
    ErrorPolicy,
    RacePolicy,
    RunArg,
    SessionOptions,
)
from .session import OptimizerArg, Session

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from dstt.engine.state.torch_state import Stateful
    from dstt.store._internal import DeltaPolicy, Retention

__all__ = ["open_session", "session"]


def session(
    model: torch.nn.Module | None,
    optimizer: OptimizerArg = None,
    *,
    run: RunArg,
    every: int | Literal["auto"] = 1,
    max_gap: int = DEFAULT_MAX_GAP,
    scheduler: Any = None,
    resume: bool = False,
    budget_bytes: int = DEFAULT_BUDGET,
    race_policy: RacePolicy = "raise",
    verify: bool = False,
    error_policy: ErrorPolicy = "raise",
    extra_state: Mapping[str, Stateful] | None = None,
    writers: int | None = None,
    max_backlog: int = 16,
    summaries: bool = True,
    encoding: DeltaPolicy | None = None,
    copy: CopyMode = "async",
    retention: Retention | None = None,
    rank_timeout: float = DEFAULT_RANK_TIMEOUT,
    start_timeout: float = DEFAULT_START_TIMEOUT,
    replay: str | None = None,
) -> Session:
    """Capture every ``every``-th optimizer step of ``model``/``optimizer`` into ``run``, and the
    last step when the block ends (the metrics of the steps between ride with the next commit).
    ``every="auto"``: store each step the engine can take without blocking training, within 5 %
    of its time (on several ranks: every rank) and record the others as light steps (metrics,
    sample indices, loss fingerprint, rebuilt on demand by ``run.rebuild``), a stored step
    forced after ``max_gap`` light ones. ``replay="train.py:make"`` records a function returning
    ``run.rebuild``'s objects as a dict, so ``dstt.open(run, replay=True)`` rebuilds light steps
    with it. ``optimizer`` may be one optimizer, a list or a dict of them (each holding other
    parameters: one step is an iteration in which each of them stepped; each one's state is
    captured and resumed). The optimizers must hold the model's trainable parameters
    (``ConfigError`` otherwise; trainable ones left out warn with ``DsttWarning``).

    Under PyTorch-native parallelism (DDP, FSDP2, tensor parallel: any initialized process
    group) call it on every rank with the same arguments: each rank writes its share (a
    DTensor's local shard, replicated state once across the ranks) and rank 0 commits a step
    once every rank's part is durable (see ``dstt.training.distributed`` and
    docs/distributed.md). ``model`` may also be a DeepSpeed engine
    (``deepspeed.initialize``'s first result; leave ``optimizer`` unset): every rank then
    captures its own share — ZeRO partitions included — the same way (see
    ``dstt.training.deepspeed``).

    Use as a context manager. ``resume=True`` restores the latest committed step of the run's
    current timeline (model, optimizer, scheduler, RNG, data position, ``extra_state``)
    bit-exactly before the block runs; ``s.step`` then tells how many steps were already taken.
    ``budget_bytes`` bounds the host cache (allocated once; copies wait when it is full) and
    ``max_backlog`` the steps awaiting their commit; both stall training honestly (at the next
    optimizer step, measured in ``s.metrics``) when the disk is slower than training.
    ``writers`` is the number of writer threads (default: one less than the cores, at most 4).
    ``summaries`` stores write-time statistics of every parameter per step (norms, NaN/Inf
    counts, update norms — exact in the flat lane; see ``dstt.engine.capture.summaries``), computed
    from the host copy by the writer (the flusher process where it runs);
    ``summaries=False`` saves that CPU (docs/performance.md).
    ``encoding=dstt.DeltaPolicy()`` writes fewer bytes: XOR deltas against the previous step,
    Adam(W) ``exp_avg_sq`` and parameters predicted from the update rule (about 2.6x fewer
    bytes for fp32 Adam state), keyframes every K steps, unchanged chunks referenced instead
    of rewritten; a step is written raw when the writers lack the CPU (docs/decisions.md).
    ``copy``: when host tensors are copied into the host cache. ``"async"`` (default) on a
    copy thread while the next forward/backward runs (the lazy copy; a version guard catches
    in-place writes in that window); ``"sync"`` on the training thread before the optimizer
    hook returns (no window, no hand-off; a few ms per step); ``"auto"`` sync only where torch
    already uses every core. CUDA tensors are always copied lazily on a side stream.
    ``retention=dstt.Retention(keep_last=..., keep_every=..., spike_window=...)`` prunes the
    run in the background while it trains (every ``every_commits`` captured steps, under this
    session's lock), so a run of any length keeps bounded tensor bytes: the recent past, every
    K-th older step and the window around every loss spike; heads and fork points always.
    Metrics and summaries of pruned steps stay; the next commit after a gc carries
    ``retention/pruned_steps`` and ``retention/freed_bytes``.
    ``rank_timeout``: seconds the ranks of a distributed run wait for one another once
    started; ``start_timeout``: seconds they wait for each other to start the session (a
    session on some ranks only fails after it). A rank that is killed is noticed by its
    silent heartbeat (30 s, or half ``rank_timeout`` if shorter) and one that raised by its
    session's end: rank 0 then gives up the steps awaiting it at once (``RankLostError``).
    Every option is checked up front (``ConfigError``); ``dstt.SessionOptions`` holds them.
    """
    options = SessionOptions(
        run=run,
        every=every,
        max_gap=max_gap,
        resume=resume,
        budget_bytes=budget_bytes,
        race_policy=race_policy,
        verify=verify,
        error_policy=error_policy,
        writers=writers,
        max_backlog=max_backlog,
        summaries=summaries,
        encoding=encoding,
        copy=copy,
        retention=retention,
        rank_timeout=rank_timeout,
        start_timeout=start_timeout,
        replay=replay,
    )
    return open_session(model, optimizer, options, scheduler=scheduler, extra_state=extra_state)


def open_session(
    model: torch.nn.Module | None,
    optimizer: OptimizerArg,
    options: SessionOptions,
    *,
    scheduler: Any = None,
    extra_state: Mapping[str, Stateful] | None = None,
) -> Session:
    """The session class for what is given (a DeepSpeed engine, or a plain model), built
    from ``options``: what :func:`session` and the framework callbacks call."""
    cls: type[Session] = Session
    if model is not None and _deepspeed_engine(model):
        from .deepspeed import DeepSpeedSession

        cls = DeepSpeedSession
    elif model is not None and (_process_group() or any(map(is_dtensor, model.parameters()))):
        from .distributed import DistributedSession

        cls = DistributedSession
    return cls(model, optimizer, options=options, scheduler=scheduler, extra_state=extra_state)


def _deepspeed_engine(model: object) -> bool:
    """Whether ``model`` is a DeepSpeed engine; ``dstt.engine.ds.deepspeed`` (which says so)
    is imported only for an object of a ``deepspeed`` class."""
    if not any(c.__module__.startswith("deepspeed") for c in type(model).__mro__):
        return False
    from dstt.engine.ds.deepspeed import is_deepspeed_engine

    return is_deepspeed_engine(model)


def _process_group() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized())
