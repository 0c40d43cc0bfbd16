"""Data attribution: which samples each step trained on, and skipping exactly those on resume.

``s.data(loader)`` wraps the loader in :class:`RecordedData`, which files a *fingerprint* of
every batch under the optimizer step it feeds: the sample indices, through a tap on a
``DataLoader``'s index sampler (:func:`index_tap`: nothing read twice, nothing hashed), else a
blake2b hash of the batch (:data:`HASH_LIMIT` bytes at most). Each commit carries the
fingerprints since the previous one as ``data/batches``. A rollback's *skip set*
(:func:`write_skips`, under ``_dstt/skips/``) makes every session resumed on that timeline drop
those samples before they are fetched, and the matching batches. Rejected alternative: the
fingerprint in the per-step ``data`` position object — that object exists only for committed
steps. Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dstt.engine.state.data_position import DataPosition, TrackedData
from dstt.errors import ConfigError
from dstt.store._internal import Batch, SkipSet, read_skips, write_skips

__all__ = [
    "HASH_LIMIT",
    "Batch",
    "BatchLog",
    "Passthrough",
    "RecordedData",
    "SkipSet",
    "fingerprint",
    "index_tap",
    "read_skips",
    "write_skips",
]

HASH_LIMIT = 64 * 1024 * 1024  # bytes hashed per batch at most (about 30 ms)


def fingerprint(batch: Any) -> Batch:
    """The hash fingerprint of a batch (see the module docstring for what is hashed)."""
    h = hashlib.blake2b(digest_size=16)
    budget = [HASH_LIMIT]
    partial = [False]

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            if x.device.type != "cpu" or x.numel() * x.element_size() > budget[0]:
                partial[0] = True
                return
            t = x.detach().contiguous()
            budget[0] -= t.numel() * t.element_size()
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, np.ndarray):
            h.update(f"A{x.dtype}{x.shape}".encode())
            if x.nbytes > budget[0] or x.dtype == object:
                partial[0] = True
                return
            budget[0] -= x.nbytes
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, Mapping):
            for k in sorted(x, key=str):
                h.update(f"K{k!s}".encode())
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                feed(v)
        else:
            h.update(f"S{type(x).__name__}:{x!r}".encode())

    feed(batch)
    return Batch(hash=h.hexdigest(), partial=partial[0])


class Passthrough:
    """Delegates everything it does not define to the sampler it stands in for (``len``,
    ``batch_size``, ``set_epoch``, a shard's ``num_processes``, ...)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class BatchLog:
    """Fingerprints per step, from ``s.data`` to the commit that carries them."""

    def __init__(self) -> None:
        self._steps: dict[int, list[Batch]] = {}

    def add(self, step: int, batch: Batch) -> None:
        self._steps.setdefault(step, []).append(batch)

    def take(self, step: int) -> dict[str, Any] | None:
        """The ``data/batches`` object for a commit of ``step`` (None if nothing recorded)."""
        mine = sorted(k for k in self._steps if k <= step)
        if not mine:
            return None
        return {"steps": mine, "batches": [[b.plain() for b in self._steps.pop(k)] for k in mine]}


class RecordedData(TrackedData):
    """:class:`TrackedData` that fingerprints each batch, drops skipped samples and batches,
    and resumes a stateful loader from its saved state (see the module docstring)."""

    def __init__(
        self,
        loader: Iterable[Any],
        position: DataPosition,
        *,
        skip: int,
        on_next: Callable[[], None] | None,
        step: Callable[[], int],
        log: BatchLog,
        skips: SkipSet,
    ) -> None:
        super().__init__(loader, position, skip=skip, on_next=on_next)
        self._step_of_next = step
        self._log = log
        self._skips = skips
        self._skip_indices = {b.indices for b in skips.batches if b.indices is not None}
        self._skip_hashes = {b.hash for b in skips.batches if b.indices is None}
        self._queue: list[list[int]] | None = None  # this pass's tap queue

    def _begin_pass(self) -> None:
        """Set the loader's index tap (installed on first use) to record and filter this
        pass; without one (no fetch by index in order) batches are fingerprinted by hash."""
        tap = index_tap(self.loader)
        if tap is None and self._skips.samples:
            raise ConfigError(
                "this run's timeline skips samples, but the loader does not expose the "
                "sample indices of its batches (a torch DataLoader over a map-style "
                "dataset, in_order=True, does); roll back with skip_batches=[steps]"
            )
        if tap is not None:
            tap.queue.clear()
            tap.samples, tap.lists = self._skips.samples, self._skip_indices
        self._queue = tap.queue if tap is not None else None

    def _skipped(self) -> None:
        if self._queue:
            self._queue.pop(0)

    def _keep(self, batch: Any) -> bool:
        queue = self._queue
        fp = Batch(indices=tuple(queue.pop(0))) if queue else fingerprint(batch)
        if fp.indices is None and fp.hash in self._skip_hashes:
            return False
        self._log.add(self._step_of_next() + 1, fp)
        return True


class _Tap(Passthrough):
    """Stands in for a DataLoader's index sampler: passes its index lists through, recording
    each (``queue``, in the order the loader fetches them: the order its batches come back)
    and dropping the skipped samples and index lists. Everything else (``len``,
    ``set_epoch``, ``state_dict``) is the wrapped sampler's."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.queue: list[list[int]] = []
        self.samples: frozenset[int] = frozenset()
        self.lists: set[tuple[int, ...]] = set()

    def admit(self, idx: Any) -> Any:
        """``idx`` as the loader should fetch it (samples dropped), or None to skip it."""
        many = isinstance(idx, Sequence)
        flat = [int(i) for i in (idx if many else [idx])]
        if self.samples:
            kept = [i for i in flat if i not in self.samples]
            if not kept:
                return None
            if len(kept) < len(flat):
                flat, idx = kept, (kept if many else kept[0])
        if tuple(flat) in self.lists:
            return None
        self.queue.append(flat)
        return idx

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        stateful = callable(getattr(it, "state_dict", None)) and callable(
            getattr(it, "load_state_dict", None)
        )
        return (_StatefulTapIter if stateful else _TapIter)(self, it)


class _TapIter:
    def __init__(self, tap: _Tap, inner: Iterator[Any]) -> None:
        self.tap, self.inner = tap, inner

    def __iter__(self) -> _TapIter:
        return self

    def __next__(self) -> Any:
        while True:
            idx = self.tap.admit(next(self.inner))
            if idx is not None:
                return idx


class _StatefulTapIter(_TapIter):
    """Keeps the wrapped iterator's ``state_dict``: torchdata saves and restores it."""

    def state_dict(self) -> Any:
        return self.inner.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: Any) -> None:
        self.inner.load_state_dict(state)  # type: ignore[attr-defined]


def index_tap(loader: Any) -> _Tap | None:
    """The loader's :class:`_Tap`, installed in place of its index sampler on first use; None
    for loaders that do not fetch by index in order (not a ``DataLoader``, an
    ``IterableDataset``, ``in_order=False``)."""
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return None
    if getattr(loader, "in_order", True) is False:
        return None
    attr = "batch_sampler" if loader.batch_sampler is not None else "sampler"
    current = getattr(loader, attr)
    if isinstance(current, _Tap):
        return current
    tap = _Tap(current)
    object.__setattr__(loader, attr, tap)  # DataLoader refuses a plain setattr after init
    return tap
