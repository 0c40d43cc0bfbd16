"""The data-loader position: epoch and batches consumed, and the wrapper that counts them.

``TrackedData`` counts the batches a loader yields and, after a resume, skips the ones the
restored step had consumed by drawing and dropping them (exact for deterministic loaders; a
shuffled ``DataLoader`` must be seeded per epoch for the order to repeat; the session restores
a loader with ``state_dict()``/``load_state_dict()`` instead). ``on_next`` runs before each
batch is drawn, the end of the previous iteration: where the session captures its boundary
state (see ``dstt.engine.state.torch_state``).
Rejected alternative: a subclass with its own copy of the iteration loop — the pass has hooks
(``_begin_pass``, ``_skipped``, ``_keep``) through which ``dstt.training.data`` records and filters
batches instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

__all__ = ["DataPosition", "TrackedData"]


@dataclass(frozen=True)
class DataPosition:
    """Where the data stream is: epoch and batches consumed in it (and in total)."""

    epoch: int = 0
    batch: int = 0
    total: int = 0


class TrackedData:
    """Iterable wrapper counting batches; skips the already-consumed ones after a resume.

    ``on_next`` is called before each batch is drawn: the end of the previous iteration.
    One pass over the wrapper is one epoch. The first pass skips ``skip`` batches (on resume:
    the batches the restored step had consumed) by drawing and dropping them (exact for
    deterministic loaders; a shuffled ``DataLoader`` must be seeded per epoch for the order to
    repeat).
    """

    def __init__(
        self,
        loader: Iterable[Any],
        position: DataPosition = DataPosition(),
        *,
        skip: int = 0,
        on_next: Callable[[], None] | None = None,
    ) -> None:
        self.loader = loader
        self.position = position
        self._skip = skip
        self._on_next = on_next

    def __len__(self) -> int:
        return len(self.loader) - self._skip  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.position.epoch)  # type: ignore[union-attr]
        self._begin_pass()
        it = iter(self.loader)
        skip, self._skip = self._skip, 0
        for _ in itertools.islice(it, skip):
            self._skipped()
        while True:
            if self._on_next is not None:
                self._on_next()  # the iteration boundary, before the loader advances
            try:
                batch = next(it)
            except StopIteration:
                break
            p = self.position
            self.position = DataPosition(p.epoch, p.batch + 1, p.total + 1)
            if self._keep(batch):
                yield batch
        self.position = DataPosition(self.position.epoch + 1, 0, self.position.total)

    # hooks for subclasses (``dstt.training.data`` records and filters batches through them)
    def _begin_pass(self) -> None:
        """A pass starts: the epoch is set, the loader's iterator not yet made."""

    def _skipped(self) -> None:
        """One already-consumed batch was drawn and dropped (resume)."""

    def _keep(self, batch: Any) -> bool:
        """Whether to hand ``batch`` to training (it counts as consumed either way)."""
        return True

    def state(self) -> dict[str, int]:
        p = self.position
        return {"epoch": p.epoch, "batch": p.batch, "total": p.total}
