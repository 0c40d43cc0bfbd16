"""Reading a commit's tensors by chunk: verified chunk bytes, delta chains decoded through
their bases — the chunk half of :class:`~dstt.store.read.reader.Reader`.

Every chunk read is checked (size, crc32c against the arrays table and its own trailer); an
XOR or ``PRED`` chunk is rebuilt from its base and checked against the raw chunk's crc32c;
decoded chunks sit in a byte-bounded LRU. A ``ChunkReader`` is composed into the ``Reader``,
which tells it how to find headers and records and what a vanished file means; the reader's
``read_array``/``read_rows`` build on its overridable ``read_chunk``.

Rejected alternatives: a mixin of the reader in this module (one class split across two files,
typed by a back-reference); module-level functions taking the reader (the same coupling,
untyped).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from dstt._lru import LRU
from dstt.errors import ChecksumError, CorruptRunError
from dstt.store.format.envelope import checksum

if TYPE_CHECKING:
    from collections.abc import Callable

    from dstt.store.format.records import ArrayRecord, ChunkRecord, CommitHeader
    from dstt.store.storage.base import Storage

__all__ = ["ChunkReader"]


class ChunkReader:
    """Verified chunks and delta chains of committed steps."""

    def __init__(
        self,
        storage: Storage,
        *,
        header: Callable[[int], CommitHeader],
        record: Callable[[CommitHeader, str], ArrayRecord],
        missing: Callable[[CommitHeader, str], NoReturn],
    ) -> None:
        """``header``: the commit of a slot; ``record``: an array's record in a commit;
        ``missing``: raise for a file that vanished under a commit (``StepNotFoundError``
        when gc pruned it meanwhile, else ``CorruptRunError``)."""
        self.storage = storage
        self.header, self.record, self._missing = header, record, missing
        #: decoded delta chunks (trajectories walk chains in order), bounded in bytes
        self._decoded: LRU[tuple[str, int], np.ndarray] = LRU(
            1 << 30, weigh=lambda a: int(a.nbytes), max_weight=256 << 20
        )

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
            self._missing(header, where)
        if len(data) != chunk.nbytes:
            raise CorruptRunError(
                f"{where}: {len(data)} bytes at offset {chunk.offset}, {chunk.nbytes} "
                "committed (truncated?)"
            )
        body = memoryview(data)[:-4]
        (trailer,) = struct.unpack("<I", data[-4:])
        if checksum(body) != chunk.crc32c or trailer != chunk.crc32c:
            raise ChecksumError(
                f"{where}: crc32c mismatch ({what}, step {header.step}); the chunk is damaged"
            )
        return body

    def _chunk(
        self, header: CommitHeader, path: str, index: int, chunk: ChunkRecord, size: int, depth: int
    ) -> memoryview:
        what = f"chunk {index} of {path!r}"
        if chunk.encoding == "raw":
            return self._file(header, chunk, what)[:size]
        cached = self._decoded.get((chunk.key, chunk.offset))
        if cached is not None:
            return cached.data
        if depth > 4096 or chunk.base is None:
            raise CorruptRunError(f"{self.storage.location}/{chunk.key}: broken delta chain")
        # the codecs load with the first encoded chunk: listing a run reads none (issue 37)
        from dstt.store.codec.predict import PRED, predict
        from dstt.store.codec.xor import XOR, xor_decode

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
            raise ChecksumError(
                f"{self.storage.location}/{chunk.key}: reconstructed {what} "
                f"of step {header.step} fails its crc32c"
            )
        self._decoded.put((chunk.key, chunk.offset), raw)
        return raw.data

    def _input(self, slot: int, path: str, index: int, size: int, depth: int) -> np.ndarray:
        """Raw bytes of chunk ``index`` of ``path`` at ``slot``: a delta's base or input."""
        h = self.header(slot)
        rec = self.record(h, path)
        if index >= len(rec.chunks):
            raise CorruptRunError(
                f"{self.storage.location}: step {h.step} has no chunk "
                f"{index} of {path!r}, which a delta is based on"
            )
        start, stop = rec.plan.byte_range(index)
        if stop - start != size:
            raise CorruptRunError(
                f"{self.storage.location}: chunk {index} of {path!r} in step "
                f"{h.step} has {stop - start} bytes; a delta based on it "
                f"expects {size}"
            )
        data = self._chunk(h, path, index, rec.chunks[index], size, depth + 1)
        return np.frombuffer(data, dtype=np.uint8)
