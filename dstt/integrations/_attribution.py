"""Data attribution and skip sets for loops a framework owns (the HF Trainer, Lightning).

A callback cannot wrap a framework's loop, but it can reach the loader the framework built:
:func:`attach` stands a :class:`StepRecorder` in for its *batch sampler*, which passes each
index list through unchanged and keeps it in order; the callback takes as many lists as each
optimizer step had micro-batches. A rollback's skipped samples leave the index lists before
anything is fetched, so every batch keeps its place and the framework's count-based resume
stays right; a batch with every sample skipped raises ``ConfigError``. :func:`file_ranks`
files the ranks' lists together. Rejected: wrapping the framework's iterator (out of a
callback's reach); a sampler re-batching the stream without the skipped samples (every later
batch would change, and the count the framework resumes by). Details: docs/decisions.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dstt.errors import ConfigError
from dstt.store._internal import Batch
from dstt.training.data import Passthrough

if TYPE_CHECKING:
    from dstt.training import Session

__all__ = ["StepRecorder", "attach", "file_ranks", "skip_error"]


def skip_error(kept: Sequence[int], dropped: Sequence[int]) -> ConfigError | None:
    """The error for a batch whose samples are all skipped (None while one is kept)."""
    if kept:
        return None
    return ConfigError(
        f"every sample of a batch is in this timeline's skip set ({sorted(dropped)}): the "
        "framework resumes by counting the batches it consumed, so dstt cannot drop a whole "
        "batch without shifting every later step; roll back again keeping at least one "
        "sample of each batch (skip the worst ones: replay(...).worst(n))"
    )


def _flat(idx: Any) -> list[int]:
    return [int(i) for i in (idx if isinstance(idx, Sequence) else [idx])]


class StepRecorder(Passthrough):
    """Stands in for a loader's batch sampler: records every index list it yields (``queue``,
    fetch order) and drops the ``skip`` samples from each (see the module docstring)."""

    def __init__(self, inner: Any, skip: frozenset[int] = frozenset()) -> None:
        super().__init__(inner)
        self.queue: deque[list[int]] = deque()
        self.skip = skip
        self._discard = 0

    def __iter__(self) -> Iterator[Any]:
        for idx in self.inner:
            flat = _flat(idx)
            if self.skip:
                kept = [i for i in flat if i not in self.skip]
                err = skip_error(kept, flat)
                if err is not None:
                    raise err
                if len(kept) < len(flat):
                    flat, idx = kept, kept
            self.queue.append(flat)
            yield idx

    def take(self, n: int) -> list[list[int]]:
        """The next ``n`` recorded index lists (fewer if fewer were fetched), after the
        ones :meth:`discard` set aside."""
        while self._discard and self.queue:
            self.queue.popleft()
            self._discard -= 1
        return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]

    def discard(self, n: int) -> None:
        """Forget the next ``n`` lists fetched (the batches a framework draws and throws
        away to resume mid-epoch)."""
        self._discard += n


class _GlobalCheck(Passthrough):
    """Under a data-parallel shard: sees every rank's batches and raises on an emptied one
    (on every rank alike); the filtering itself is each rank's recorder's."""

    def __init__(self, inner: Any, skip: frozenset[int]) -> None:
        super().__init__(inner)
        self.skip = skip

    def __iter__(self) -> Iterator[Any]:
        for idx in self.inner:
            flat = _flat(idx)
            err = skip_error([i for i in flat if i not in self.skip], flat)
            if err is not None:
                raise err
            yield idx


def attach(loader: Any, skip: frozenset[int] = frozenset()) -> StepRecorder | None:
    """Install a :class:`StepRecorder` on ``loader`` (a torch ``DataLoader``, or accelerate's
    wrapper of one) and return it; the one already there if any. None when the loader does
    not fetch by index lists in order (no ``DataLoader``, an ``IterableDataset``,
    ``in_order=False``, no batch sampler): the caller records positions only and refuses a
    skip set."""
    import torch

    base = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard
    if not isinstance(base, torch.utils.data.DataLoader):
        return None
    if isinstance(base.dataset, torch.utils.data.IterableDataset):
        return None
    if getattr(base, "in_order", True) is False or base.batch_sampler is None:
        return None
    top: Any = base.batch_sampler
    if isinstance(top, StepRecorder):
        top.skip = skip
        return top
    below = getattr(top, "batch_sampler", None)
    if skip and below is not None and hasattr(top, "num_processes"):  # a data-parallel shard
        if getattr(top, "split_batches", False):
            raise ConfigError(
                "this timeline skips samples, but the loader splits each batch across "
                "processes (accelerate's split_batches=True), which needs full batches: "
                "train without split_batches to resume it"
            )
        if not isinstance(below, _GlobalCheck):
            top.batch_sampler = _GlobalCheck(below, skip)
    rec = StepRecorder(top, skip)
    object.__setattr__(base, "batch_sampler", rec)  # DataLoader refuses a plain setattr
    return rec


def file_ranks(s: Session, step: int, batches: list[Batch]) -> None:
    """File every rank's ``batches`` (rank-major) under ``step``; this rank's alone
    without a process group. A collective: every rank calls it at the same point."""
    import torch.distributed as dist

    mine = [b.plain() for b in batches]
    ranks: list[Any] = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    log = s._batches  # noqa: SLF001 - the per-step records s.data() fills
    for plain in ranks:
        for fp in plain:
            log.add(step, Batch.from_plain(fp))
