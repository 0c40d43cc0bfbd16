"""A step's arrays table from what its transaction recorded: columns, not records.

A flat write records its chunks as columns (offsets, sizes, crc32c; for an encoded step also
each chunk's file and its codec entries, ``commit/flat_encode.py``), a chunk-by-chunk write a
``ChunkRecord`` per chunk. This builds the step's table from both (``manifest.TableBuilder``),
splices a raw flat step's from cached columns (``TableTemplate``), and gives the records
themselves to the callers that need objects (a part's vote, a merge). A mixin of
``Transaction`` (as ``read/chunks.py`` is of the reader): the transaction holds the state.
Rejected alternative: building ``ChunkRecord`` objects for every write — ~3 µs per chunk per
step, where the columns cost a list extend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import DsttError
from ..format.flat import FlatLayout
from ..format.layout import ChunkPlan
from ..format.manifest import TableBuilder, TableTemplate, dump_arrays
from ..format.records import ArrayRecord, ChunkRecord

if TYPE_CHECKING:
    from ..format.stepfile import StepFile
    from .writer import Writer

__all__ = ["StepTableMixin"]


def _record(key: str, nbytes: int, crc: int, offset: int,
            codec: Sequence[Any] | None) -> ChunkRecord:
    """A chunk record from a flat step's columns and its codec entry (None: raw)."""
    if codec is None:
        return ChunkRecord(key, nbytes, crc, offset=offset)
    enc, base, raw = codec[0], codec[1], codec[2]
    if len(codec) == 3:
        return ChunkRecord(key, nbytes, crc, enc, base, raw, offset=offset)
    return ChunkRecord(key, nbytes, crc, enc, base, raw, codec[3],
                       tuple((p, int(s)) for p, s in codec[4]), tuple(codec[5]), offset=offset)


class StepTableMixin:
    """The table half of :class:`~dstt.store.commit.transaction.Transaction`."""

    writer: Writer
    slot: int
    step: int
    zip: StepFile
    _plans: dict[str, tuple[str, ChunkPlan]]
    _chunks: dict[str, list[ChunkRecord | None]]
    _flat: list[tuple[list[int], list[int], list[int]]]
    _flat_layouts: list[FlatLayout]
    _flat_enc: list[tuple[list[str], Mapping[int, Any]] | None]
    _flat_span: dict[str, tuple[int, int, int]]

    def table(self) -> TableBuilder:
        """The columnar arrays table of this step (``manifest.TableBuilder``)."""
        b = TableBuilder()
        zip_id = b.file_id(self.zip.key)
        ids: list[list[int] | None] = [
            None if e is None else list(map(b.file_id, e[0])) for e in self._flat_enc]
        for path, (dtype, plan) in self._plans.items():
            b.add_array(path, dtype, plan.shape, plan.rows, self.writer._dims.get(path))
            span = self._flat_span.get(path)
            if span is not None:
                put, lo, hi = span
                offs, sizes, crcs = self._flat[put]
                enc, fid = self._flat_enc[put], ids[put]
                if enc is None or fid is None:
                    b.add_chunks(zip_id, offs[lo:hi], sizes[lo:hi], crcs[lo:hi])
                    continue
                first = len(b.offset)
                b.file.extend(fid[lo:hi])
                b.offset.extend(offs[lo:hi])
                b.nbytes.extend(sizes[lo:hi])
                b.crc32c.extend(crcs[lo:hi])
                codecs = enc[1]
                b.codecs.update((str(first + j - lo), list(codecs[j]))
                                for j in range(lo, hi) if j in codecs)
                continue
            for c in self._complete(path):
                b.add_record(c)
        return b

    def table_parts(self) -> tuple[TableTemplate, list[int], list[int]] | None:
        """A step written whole from one flat layout (the hot path): its arrays table as
        the layout's cached fixed columns and this step's offsets and checksums, spliced
        by ``TableTemplate.dump``; None for anything else."""
        if len(self._flat) == 1 and not self._chunks and self._flat_enc[0] is None:
            layout = self._flat_layouts[0]
            offsets, sizes, crcs = self._flat[0]
            if len(self._plans) == len(layout.arrays):
                tpl = self.writer.table_template(layout, sizes)
                if tpl.sizes == sizes:
                    return tpl, offsets, crcs
        return None

    def arrays_table(self) -> bytes:
        """This step's sealed arrays table (``manifest.dump_arrays``): spliced from cached
        columns where ``table_parts`` has them, else built array by array."""
        parts = self.table_parts()
        if parts is not None:
            return parts[0].dump(self.slot, self.zip.key, parts[1], parts[2])
        if (len(self._flat) == 1 and not self._chunks and self._flat_enc[0] is not None
                and len(self._plans) == len(self._flat_layouts[0].arrays)):
            return self._encoded_table()
        return dump_arrays(self.slot, self.table())

    def _encoded_table(self) -> bytes:
        """An encoded step written whole from one flat layout: the layout's cached fixed
        columns spliced with this step's (``TableTemplate.dump_columns``), the same bytes
        ``dump_arrays(slot, self.table())`` makes with Python per array."""
        layout = self._flat_layouts[0]
        offsets, sizes, crcs = self._flat[0]
        enc = self._flat_enc[0]
        assert enc is not None
        keys, codecs = enc
        files = list(dict.fromkeys([self.zip.key, *keys]))  # first appearance, as file_id
        ids = dict(zip(files, range(len(files)), strict=True))
        tpl = self.writer.table_template(layout)
        return tpl.dump_columns(self.slot, files, list(map(ids.__getitem__, keys)), sizes,
                                offsets, crcs,
                                dict(zip(map(str, codecs), map(list, codecs.values()),
                                         strict=True)))

    def _complete(self, path: str) -> list[ChunkRecord]:
        span = self._flat_span.get(path)
        if span is not None:
            offs, sizes, crcs = self._flat[span[0]]
            enc = self._flat_enc[span[0]]
            if enc is not None:
                return [_record(enc[0][k], sizes[k], crcs[k], offs[k], enc[1].get(k))
                        for k in range(span[1], span[2])]
            return [ChunkRecord(self.zip.key, sizes[k], crcs[k], offset=offs[k])
                    for k in range(span[1], span[2])]
        chunks = self._chunks[path]
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise DsttError(f"step {self.step}: chunks {missing[:8]} of {path!r} were "
                            "never written; refusing to commit an incomplete step")
        return chunks  # type: ignore[return-value]

    def records(self) -> dict[str, ArrayRecord]:
        out = {}
        for path, (dtype, plan) in self._plans.items():
            if path in self._flat_span:
                out[path] = ArrayRecord(path, dtype, plan.shape, plan.rows,
                                        tuple(self._complete(path)),
                                        self.writer._dims.get(path))
                continue
            chunks = self._chunks[path]
            missing = [i for i, c in enumerate(chunks) if c is None]
            if missing:
                raise DsttError(f"step {self.step}: chunks {missing[:8]} of {path!r} were "
                                "never written; refusing to commit an incomplete step")
            out[path] = ArrayRecord(path, dtype, plan.shape, plan.rows,
                                    tuple(c for c in chunks if c is not None),
                                    self.writer._dims.get(path))
        return out
