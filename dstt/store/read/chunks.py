"""Reading a commit's tensors by chunk: verified chunk bytes, delta chains decoded through
their bases, whole arrays and row ranges — the chunk half of
:class:`~dstt.store.read.reader.Reader`.

Every chunk read is checked (size, crc32c against the arrays table and the chunk's own
trailer); an XOR or predicted (``PRED``) chunk is rebuilt from its base and inputs and checked
against the raw chunk's crc32c. Decoded chunks are kept in the reader's byte-bounded LRU, so
scrubbing consecutive steps costs one read per step of a chain. A mixin rather than more of
``read/reader.py`` (as ``_run_diagnose.py`` is for ``Run``): the reader provides the attributes and
methods it uses. Rejected alternative: module-level functions taking the reader (as
``index_reader.scalar_rows``), which would leave ``read_chunk``/``read_array``/``read_rows``,
the reader's API, as forwarding stubs in ``read/reader.py``.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ChecksumError, CorruptRunError
from ..codec.predict import PRED, predict
from ..codec.xor import XOR, xor_decode
from ..format.envelope import checksum
from ..format.records import ArrayRecord, ChunkRecord, CommitHeader
from ..format.zarr_meta import numpy_dtype

if TYPE_CHECKING:
    from ..._lru import LRU
    from ..storage.base import Storage

__all__ = ["ChunkReadMixin"]


class ChunkReadMixin:
    """Methods :class:`~dstt.store.read.reader.Reader` gets from this module (it provides the
    attributes used)."""

    storage: Storage
    #: decoded delta chunks (trajectories walk chains in order), bounded in bytes
    _decoded: LRU[tuple[str, int], np.ndarray]

    if TYPE_CHECKING:
        def header(self, slot: int) -> CommitHeader: ...
        def record(self, header: CommitHeader, path: str) -> ArrayRecord: ...
        def _raise_missing(self, header: CommitHeader, where: str) -> Any: ...

    def read_chunk(self, header: CommitHeader, path: str, index: int) -> memoryview:
        """Verified bytes of chunk ``index`` of ``path`` (edge padding removed)."""
        rec = self.record(header, path)
        start, stop = rec.plan.byte_range(index)
        return self._chunk(header, path, index, rec.chunks[index], stop - start, 0)

    def _file(self, header: CommitHeader, chunk: ChunkRecord, what: str) -> memoryview:
        where = f"{self.storage.location}/{chunk.key}"
        try:
            data = self.storage.read_range(chunk.key, chunk.offset, chunk.nbytes)
        except FileNotFoundError:
            self._raise_missing(header, where)
        if len(data) != chunk.nbytes:
            raise CorruptRunError(
                f"{where}: {len(data)} bytes at offset {chunk.offset}, {chunk.nbytes} "
                "committed (truncated?)"
            )
        body = memoryview(data)[:-4]
        (trailer,) = struct.unpack("<I", data[-4:])
        if checksum(body) != chunk.crc32c or trailer != chunk.crc32c:
            raise ChecksumError(f"{where}: crc32c mismatch ({what}, step {header.step}); "
                                "the chunk is damaged")
        return body

    def _chunk(self, header: CommitHeader, path: str, index: int, chunk: ChunkRecord,
               size: int, depth: int) -> memoryview:
        what = f"chunk {index} of {path!r}"
        if chunk.encoding == "raw":
            return self._file(header, chunk, what)[:size]
        cached = self._decoded.get((chunk.key, chunk.offset))
        if cached is not None:
            return cached.data
        if depth > 4096 or chunk.base is None:
            raise CorruptRunError(f"{self.storage.location}/{chunk.key}: broken delta chain")
        payload = self._file(header, chunk, what)
        base = self._input(chunk.base, path, index, size, depth)
        try:
            if chunk.encoding == PRED and chunk.predictor is not None:
                inputs = [self._input(slot, p, index, size, depth) for p, slot in chunk.inputs]
                base = predict(chunk.predictor, base, inputs, chunk.coeffs)
            elif chunk.encoding != XOR:
                raise ValueError(f"unknown chunk encoding {chunk.encoding!r}")
            raw = xor_decode(payload, base)
        except (ValueError, RuntimeError) as e:
            raise CorruptRunError(f"{self.storage.location}/{chunk.key}: {e}") from None
        full = self.record(header, path).plan.chunk_nbytes
        crc = checksum(raw.data)
        if full > size:
            crc = checksum(bytes(full - size), crc)
        if crc != chunk.raw_crc32c:
            raise ChecksumError(f"{self.storage.location}/{chunk.key}: reconstructed {what} "
                                f"of step {header.step} fails its crc32c")
        self._decoded.put((chunk.key, chunk.offset), raw)
        return raw.data

    def _input(self, slot: int, path: str, index: int, size: int, depth: int) -> np.ndarray:
        """Raw bytes of chunk ``index`` of ``path`` at ``slot``: a delta's base or input."""
        h = self.header(slot)
        rec = self.record(h, path)
        if index >= len(rec.chunks):
            raise CorruptRunError(f"{self.storage.location}: step {h.step} has no chunk "
                                  f"{index} of {path!r}, which a delta is based on")
        start, stop = rec.plan.byte_range(index)
        if stop - start != size:
            raise CorruptRunError(f"{self.storage.location}: chunk {index} of {path!r} in step "
                                  f"{h.step} has {stop - start} bytes; a delta based on it "
                                  f"expects {size}")
        data = self._chunk(h, path, index, rec.chunks[index], size, depth + 1)
        return np.frombuffer(data, dtype=np.uint8)

    def read_array(self, header: CommitHeader, path: str) -> np.ndarray:
        """The whole tensor as a numpy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
        rec = self.record(header, path)
        plan = rec.plan
        out = np.empty(plan.nbytes, dtype=np.uint8)
        for i in range(plan.n_chunks):
            start, stop = plan.byte_range(i)
            out[start:stop] = np.frombuffer(self.read_chunk(header, path, i), dtype=np.uint8)
        return out.view(numpy_dtype(rec.dtype)).reshape(rec.shape)

    def read_rows(self, header: CommitHeader, path: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of axis 0 of a tensor, reading only the chunks that hold them."""
        rec = self.record(header, path)
        plan = rec.plan
        if not rec.shape:
            return self.read_array(header, path)
        start, stop = max(0, start), min(rec.shape[0], stop)
        dt = numpy_dtype(rec.dtype)
        if stop <= start:
            return np.empty((0, *rec.shape[1:]), dtype=dt)
        first, last = start // plan.rows, (stop - 1) // plan.rows
        parts = [np.frombuffer(self.read_chunk(header, path, i), dtype=np.uint8)
                 for i in range(first, last + 1)]
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
        block = flat.view(dt).reshape(-1, *rec.shape[1:])
        lo = start - first * plan.rows
        return block[lo: lo + (stop - start)]
