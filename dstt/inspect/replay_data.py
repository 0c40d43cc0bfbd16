"""The batches of a past step, rebuilt from its recorded sample indices (``data/batches``):
through a ``dataset`` (and ``collate``), a callable from indices, or a kit's ``make_batch``;
and the slicing of a batch into its samples for the per-sample pass.

Given batches (``batches=[...]``) are taken as they are and matched to the recorded indices
only where they fit. Rejected: hashing the given batches to find their indices (a hash
cannot name a sample; the record can).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dstt.errors import ConfigError, ReplayError

__all__: list[str] = []


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
