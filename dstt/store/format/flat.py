"""A whole step as one flat buffer: where every tensor sits in it, and how it becomes a zip.

The capture engine's hot path copies every tensor of a step into ONE host buffer (one batched
copy) and hands the buffer to the store. ``FlatLayout`` is computed once per set of tensors
(path, dtype, shape, and optionally its dimension names) and reused while they do not change:
each tensor's offset in the buffer (64-byte aligned, so typed views of it are aligned) and its
chunks, with their zip entry names.
``Transaction.put_flat`` then writes the whole step with a handful of ``pwritev`` calls; the
per-step Python work per chunk is two checksums and one header (no per-chunk objects, locks or
file opens). Rejected alternative: one ``put_chunk`` call per chunk from the engine — a
lock, a dataclass and a write call per tensor holding the GIL, ~0.3 ms per tensor per step.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from .envelope import checksum, crc32c_raw
from .layout import ChunkPlan, zarr_chunk_key
from .zarr_meta import check_dims
from .zipfmt import Entry, crc32, crc32_raw, directory_records, header_size, local_header

if TYPE_CHECKING:
    from collections.abc import Sequence

#: the two sums of an in-place entry, in the order ``_fill_inplace`` calls them
_BOTH = (crc32c_raw, crc32_raw)

__all__ = ["ArraySpec", "FlatArray", "FlatImage", "FlatLayout", "StepBytes", "byte_view"]

#: the bytes of a chunk or of a whole flat step, as a transaction takes them: a buffer, or a
#: numpy array's memory (a pinned host slab's ``.numpy()``, a step buffer)
StepBytes: TypeAlias = "bytes | bytearray | memoryview | npt.NDArray[np.generic]"
#: an array of a flat layout: path, dtype, shape and optionally its dimension names
ArraySpec: TypeAlias = (
    "tuple[str, str, tuple[int, ...]] | tuple[str, str, tuple[int, ...], Sequence[str] | None]"
)
#: the same with its chunk plan for the shape (what ``FlatLayout.build`` lays out)
PlannedSpec: TypeAlias = (
    "tuple[str, str, ChunkPlan] | tuple[str, str, ChunkPlan, Sequence[str] | None]"
)


def byte_view(data: StepBytes) -> memoryview:
    """``data``'s memory as unsigned bytes, no copy (numpy's type stubs declare the buffer
    protocol from Python 3.12 only, hence the ignore)."""
    return memoryview(data).cast("B")  # type: ignore[arg-type]


ALIGN = 64


@dataclass(frozen=True)
class FlatArray:
    """One tensor of a flat step buffer: bytes ``[offset, offset + plan.nbytes)``."""

    path: str
    dtype: str
    plan: ChunkPlan
    offset: int
    #: the array's ``dimension_names`` (None: the store's default, ``<name>_<i>``)
    dims: tuple[str, ...] | None = None

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
    #: per array: (path, first chunk, end chunk) in ``chunks``
    spans: tuple[tuple[str, int, int], ...] = ()
    #: tensor bytes (without padding)
    raw_nbytes: int = 0
    #: the zip entry names of the chunks
    names: frozenset[str] = field(default_factory=frozenset)
    #: the buffer IS the step file's bytes ``[0, nbytes)``: each chunk's local header, data
    #: (64-byte aligned) and crc32c trailer in place (``heads``: where each header starts)
    framed: bool = False
    heads: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        arrays: Sequence[PlannedSpec],
        *,
        framed: bool | None = None,
    ) -> FlatLayout:
        """Lay out ``arrays``: (path, dtype, plan) or (path, dtype, plan, dims).

        ``framed`` (default: when every array is at most one chunk) leaves room for the zip
        framing around each chunk, so the buffer can be written to the file as it is — one
        write, and with ``O_DIRECT`` no copy into the page cache."""
        if framed is None:
            framed = bool(arrays) and all(spec[2].n_chunks <= 1 for spec in arrays)
        out: list[FlatArray] = []
        chunks: list[tuple[int, int, int, int, str, int]] = []
        spans: list[tuple[str, int, int]] = []
        heads: list[int] = []
        pos = 0
        for k, spec in enumerate(arrays):
            path, dtype, plan = spec[0], spec[1], spec[2]
            given = spec[3] if len(spec) > 3 else None
            dims = None if given is None else check_dims(path, len(plan.shape), given)
            spans.append((path, len(chunks), len(chunks) + plan.n_chunks))
            if not framed:
                pos = (pos + ALIGN - 1) // ALIGN * ALIGN
                out.append(FlatArray(path, dtype, plan, pos, dims))
                for i in range(plan.n_chunks):
                    start, stop = plan.byte_range(i)
                    name = zarr_chunk_key(path, plan.index(i))
                    chunks.append((k, i, pos + start, pos + stop, name, plan.chunk_nbytes))
                pos += plan.nbytes
                continue
            if plan.n_chunks > 1:
                raise ValueError(
                    f"a framed layout holds single-chunk arrays; {path!r} has "
                    f"{plan.n_chunks} chunks"
                )
            if plan.n_chunks == 0:  # empty: no entry, no bytes (an aligned empty view)
                out.append(FlatArray(path, dtype, plan, 0, dims))
                continue
            name = zarr_chunk_key(path, plan.index(0))
            size = plan.chunk_nbytes + 4
            data = pos + header_size(name, size, pos, align=ALIGN)
            heads.append(pos)
            out.append(FlatArray(path, dtype, plan, data, dims))
            chunks.append((k, 0, data, data + plan.nbytes, name, plan.chunk_nbytes))
            pos = data + size
        return cls(
            tuple(out),
            max(pos, 1),
            tuple(chunks),
            tuple(spans),
            sum(a.nbytes for a in out),
            frozenset(c[4] for c in chunks),
            framed=framed,
            heads=tuple(heads),
        )

    def index(self) -> dict[str, FlatArray]:
        return {a.path: a for a in self.arrays}

    @functools.cached_property
    def plans(self) -> dict[str, tuple[str, ChunkPlan]]:
        """path -> (dtype, plan) of every array, built once (a transaction declares them
        all at once at every step)."""
        return {a.path: (a.dtype, a.plan) for a in self.arrays}

    @functools.cached_property
    def span_columns(self) -> tuple[tuple[str, ...], tuple[int, ...], tuple[int, ...]]:
        """``spans`` as three columns (paths, first chunks, end chunks), built once: a step
        records where its arrays are with C-level zips, no Python line per array."""
        if not self.spans:
            return (), (), ()
        paths, los, his = zip(*self.spans, strict=True)
        return paths, los, his


_HEADER_CRC = 14  # offset of the CRC-32 field in a local file header
_CENTRAL_CRC = 16  # ... and in a central directory record


class FlatImage:
    """The zip entries of a ``FlatLayout`` placed at offset ``start`` of a step file, over
    one buffer: every local header, trailer and central directory record is built once, and
    a step only patches their checksum fields (numpy, no Python per chunk) — ``fill`` then
    costs two checksum calls per chunk, ``iov`` is written as it is.

    *In place* (a framed layout at ``start == 0``): the headers live in the buffer itself,
    between the tensors, so ``iov`` is ONE view of the buffer — the file's bytes as they are,
    ready for an ``O_DIRECT`` write. Otherwise (*gathered*) ``iov`` interleaves separate
    header and trailer bytes with views of the tensors.

    Not thread-safe: one image per (layout, start, buffer), used by one step at a time
    (the engine's buffers are held by one step each; the flusher process is serial). An
    in-place image owns the bytes between the tensors: after another layout used the same
    buffer, :meth:`bind` it again before :meth:`fill`.
    """

    def __init__(self, layout: FlatLayout, start: int, buf: memoryview | None) -> None:
        self.layout, self.start = layout, start
        self.inplace = layout.framed and start == 0 and bool(layout.chunks)
        n = len(layout.chunks)
        headers = bytearray()
        hdr_at: list[int] = []
        entries: list[Entry] = []
        self.offsets: list[int] = []  # data offset of each chunk (what the manifest records)
        self.sizes: list[int] = []
        off = start
        for j, (_, _, s, _, name, full) in enumerate(layout.chunks):
            size = full + 4
            if self.inplace:
                off = layout.heads[j]
                head = local_header(name, size, 0, off, align=ALIGN)
                if off + len(head) != s:  # pragma: no cover - build() and this must agree
                    raise AssertionError(f"framed layout disagrees with the header of {name!r}")
                hdr_at.append(off)
            else:
                head = local_header(name, size, 0, off)
                hdr_at.append(len(headers))
            headers += head
            entries.append(Entry(name, off, size, 0))
            off += len(head) + size
            self.offsets.append(off - size)
            self.sizes.append(size)
        self.nbytes = off - start
        self.headers = headers
        self.trailers = bytearray(4 * n)
        records = [directory_records([e]) for e in entries]
        self.directory = bytearray(b"".join(records))
        cd_at = np.cumsum([0, *map(len, records)])[:-1]  # where each entry's record starts
        four = np.arange(4, dtype=np.intp)
        self._hdr_idx = (np.asarray(hdr_at, dtype=np.intp) + _HEADER_CRC)[:, None] + four
        self._cd_idx = (np.asarray(cd_at, dtype=np.intp) + _CENTRAL_CRC)[:, None] + four
        #: in place: where each chunk's crc32c trailer sits in the buffer
        self._trl_idx = (np.add(self.offsets, self.sizes, dtype=np.intp) - 4)[:, None] + four
        self.count = n
        self.iov: list[bytes | bytearray | memoryview] = []
        self._views: list[memoryview] = []
        self._pads: dict[int, bytes] = {}
        self._buf: np.ndarray | None = None
        self._entries: list[memoryview] = []  # in place: each chunk's 4-byte trailer
        self._twice: list[memoryview] = []  # each padded chunk twice (both sums)
        self._whole = memoryview(b"")
        if buf is not None:
            self.bind(buf)

    def bind(self, buf: memoryview) -> None:
        """Point the image at a buffer (the data parts of ``iov``); in place, also write
        the headers into it and zero the chunk padding."""
        if self.inplace:
            self._bind_inplace(buf)
            return
        hv, tv = memoryview(self.headers), memoryview(self.trailers)
        iov: list[bytes | bytearray | memoryview] = []
        views: list[memoryview] = []
        pos = 0
        for j, (_, _, s, e, _, full) in enumerate(self.layout.chunks):
            hlen = self.offsets[j] - (
                self.start if j == 0 else self.offsets[j - 1] + self.sizes[j - 1]
            )
            iov.append(hv[pos : pos + hlen])
            pos += hlen
            v = buf[s:e]
            views.append(v)
            iov.append(v)
            if full > e - s:
                self._pads[j] = pad = bytes(full - (e - s))
                iov.append(pad)
            iov.append(tv[4 * j : 4 * j + 4])
        self.iov, self._views = iov, views

    def _bind_inplace(self, buf: memoryview) -> None:
        if len(buf) < self.nbytes:
            raise ValueError(f"buffer of {len(buf)} bytes, the image needs {self.nbytes}")
        arr = np.frombuffer(buf, dtype=np.uint8)
        hv = memoryview(self.headers)
        pos = 0
        views: list[memoryview] = []
        padded: list[memoryview] = []
        entries: list[memoryview] = []
        for j, (_, _, s, e, _, full) in enumerate(self.layout.chunks):
            h = self.layout.heads[j]
            buf[h:s] = hv[pos : pos + (s - h)]
            pos += s - h
            if full > e - s:
                arr[e : s + full] = 0  # chunk padding (the copy writes only the tensor)
            views.append(buf[s:e])
            padded.append(buf[s : s + full])  # what the crc32c covers
            entries.append(buf[s + full : s + full + 4])  # ... and the CRC-32: its trailer too
        self._buf, self._views = arr, views
        self._entries = entries
        self._twice = [v for p in padded for v in (p, p)]
        self._whole = buf[: self.nbytes]
        self.iov = [self._whole]

    def fill(self) -> tuple[list[int], list[int]]:
        """Checksum the bound buffer: patch trailers, headers and directory; returns the
        crc32c of each chunk and the ZIP CRC-32 of each entry."""
        if self.inplace:
            return self._fill_inplace()
        crcs = [checksum(v) for v in self._views]
        zips = [crc32(v) for v in self._views]
        for j, pad in self._pads.items():
            crcs[j] = checksum(pad, crcs[j])
            zips[j] = crc32(pad, zips[j])
        self.trailers[:] = np.asarray(crcs, dtype="<u4").tobytes()
        tv = memoryview(self.trailers)
        zips = [crc32(tv[4 * j : 4 * j + 4], z) for j, z in enumerate(zips)]
        zb = np.frombuffer(np.asarray(zips, dtype="<u4").tobytes(), dtype=np.uint8).reshape(-1, 4)
        np.frombuffer(self.headers, dtype=np.uint8)[self._hdr_idx] = zb
        np.frombuffer(self.directory, dtype=np.uint8)[self._cd_idx] = zb
        return crcs, zips

    def _fill_inplace(self) -> tuple[list[int], list[int]]:
        """``fill`` in place: every entry's bytes (data, padding, trailer) are contiguous in
        the buffer, so a step is one C checksum call per entry for each of the two sums and
        one for the trailer, mapped without a Python frame per call, and three scatters."""
        assert self._buf is not None
        # both sums of an entry back to back, while its bytes are in the core's cache (two
        # passes over the whole buffer read it twice from memory), then the trailer
        both = list(map(operator.call, itertools.cycle(_BOTH), self._twice))
        crcs = both[0::2]
        self._buf[self._trl_idx] = np.frombuffer(
            np.asarray(crcs, dtype="<u4").tobytes(), np.uint8
        ).reshape(-1, 4)
        self.trailers[:] = np.asarray(crcs, dtype="<u4").tobytes()
        zips = list(map(crc32_raw, self._entries, both[1::2]))
        zb = np.frombuffer(np.asarray(zips, dtype="<u4").tobytes(), dtype=np.uint8).reshape(-1, 4)
        self._buf[self._hdr_idx] = zb
        np.frombuffer(self.directory, dtype=np.uint8)[self._cd_idx] = zb
        return crcs, zips
