"""``dstt.session(...)``: the one entry point; picks the session class for what it is given.

A plain ``torch.nn.Module`` and optimizer get a :class:`~dstt._session_core.Session`; a
DeepSpeed engine gets a :class:`~dstt._ds_session.DeepSpeedSession`. The classes live in their
own modules and this one imports both, so imports flow one way (``_session`` →
``_ds_session`` → ``_session_core``).
Rejected alternative: the factory next to ``Session`` with a function-level import of the
DeepSpeed subclass — a cycle, hidden from import-time checks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ._ds_session import DeepSpeedSession
from ._session_core import DEFAULT_BUDGET, CopyMode, ErrorPolicy, RacePolicy, Session
from .engine.deepspeed import is_deepspeed_engine
from .engine.torch_state import Stateful
from .store import DeltaPolicy, Repository, Retention, Storage

__all__ = ["CopyMode", "DeepSpeedSession", "ErrorPolicy", "RacePolicy", "Session", "session"]


def session(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None, *,
            run: str | os.PathLike[str] | Repository | Storage, every: int = 1,
            scheduler: Any = None, resume: bool = False, budget_bytes: int = DEFAULT_BUDGET,
            race_policy: RacePolicy = "raise", verify: bool = False,
            error_policy: ErrorPolicy = "raise",
            extra_state: Mapping[str, Stateful] | None = None, writers: int | None = None,
            max_backlog: int = 16, summaries: bool = True,
            encoding: DeltaPolicy | None = None, copy: CopyMode = "async",
            retention: Retention | None = None) -> Session:
    """Capture every ``every``-th optimizer step of ``model``/``optimizer`` into ``run``, and
    the last step when the block ends (the metrics of the steps between ride with the next
    commit). ``optimizer`` must hold the model's trainable parameters (``ConfigError``
    otherwise; trainable ones left out warn with ``DsttWarning``).

    ``model`` may also be a DeepSpeed engine (``deepspeed.initialize``'s first result; leave
    ``optimizer`` unset): every rank then captures its own share — ZeRO partitions included —
    and rank 0 commits a step once every rank's part is durable (see ``dstt._ds_session``).

    Use as a context manager. ``resume=True`` restores the latest committed step of the run's
    current timeline (model, optimizer, scheduler, RNG, data position, ``extra_state``)
    bit-exactly before the block runs; ``s.step`` then tells how many steps were already taken.
    ``budget_bytes`` bounds the host cache (allocated once; copies wait when it is full) and
    ``max_backlog`` the steps awaiting their commit; both stall training honestly (at the next
    optimizer step, measured in ``s.metrics``) when the disk is slower than training.
    ``writers`` is the number of writer threads (default: one less than the cores, at most 4).
    ``summaries`` stores write-time statistics of every parameter per step (norms, NaN/Inf
    counts, update estimates; see ``dstt.engine.summaries``), computed from the host copy by
    the writer (the flusher process where it runs); ``summaries=False`` saves that CPU
    (docs/performance.md).
    ``encoding=dstt.DeltaPolicy()`` writes fewer bytes: XOR deltas against the previous step,
    Adam(W) ``exp_avg_sq`` and parameters predicted from the update rule (about 2.6x fewer
    bytes for fp32 Adam state), keyframes every K steps, unchanged chunks referenced instead
    of rewritten; a step is written raw when the writers lack the CPU (docs/design.md).
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
    """
    cls: type[Session] = Session
    if model is not None and is_deepspeed_engine(model):
        cls = DeepSpeedSession
    return cls(model, optimizer, run=run, every=every, scheduler=scheduler, resume=resume,
               budget_bytes=budget_bytes, race_policy=race_policy, verify=verify,
               error_policy=error_policy, extra_state=extra_state, writers=writers,
               max_backlog=max_backlog, summaries=summaries, encoding=encoding, copy=copy,
               retention=retention)
