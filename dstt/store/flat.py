"""A whole step as one flat buffer: where every tensor sits in it, and how it becomes a zip.

The capture engine's hot path copies every tensor of a step into ONE host buffer (one batched
copy) and hands the buffer to the store. ``FlatLayout`` is computed once per set of tensors
(path, dtype, shape) and reused while they do not change: each tensor's offset in the buffer
(64-byte aligned, so typed views of it are aligned) and its chunks, with their zip entry names.
``Transaction.put_flat`` then writes the whole step with a handful of ``pwritev`` calls; the
per-step Python work per chunk is two checksums and one header (no per-chunk objects, locks or
file opens). Rejected alternative: one ``put_chunk`` call per chunk from the engine — a
lock, a dataclass and a write call per tensor holding the GIL, ~0.3 ms per tensor per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .layout import ChunkPlan, zarr_chunk_key

__all__ = ["FlatArray", "FlatLayout"]

ALIGN = 64


@dataclass(frozen=True)
class FlatArray:
    """One tensor of a flat step buffer: bytes ``[offset, offset + plan.nbytes)``."""

    path: str
    dtype: str
    plan: ChunkPlan
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        return self.plan.shape

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes


@dataclass(frozen=True)
class FlatLayout:
    """Every tensor of a step in one buffer of ``nbytes`` bytes (padding is zero)."""

    arrays: tuple[FlatArray, ...]
    nbytes: int
    #: per chunk, in buffer order: (array index, chunk index, start, stop, zip entry name,
    #: padded chunk bytes)
    chunks: tuple[tuple[int, int, int, int, str, int], ...]

    @classmethod
    def build(cls, arrays: Sequence[tuple[str, str, ChunkPlan]]) -> FlatLayout:
        out: list[FlatArray] = []
        chunks: list[tuple[int, int, int, int, str, int]] = []
        pos = 0
        for k, (path, dtype, plan) in enumerate(arrays):
            pos = (pos + ALIGN - 1) // ALIGN * ALIGN
            out.append(FlatArray(path, dtype, plan, pos))
            for i in range(plan.n_chunks):
                start, stop = plan.byte_range(i)
                chunks.append((k, i, pos + start, pos + stop,
                               zarr_chunk_key(path, plan.index(i)), plan.chunk_nbytes))
            pos += plan.nbytes
        return cls(tuple(out), max(pos, 1), tuple(chunks))

    def index(self) -> dict[str, FlatArray]:
        return {a.path: a for a in self.arrays}
