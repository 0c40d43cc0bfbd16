"""A step's arrays table from what its transaction recorded: columns, not records.

A flat write records its chunks as columns (offsets, sizes, crc32c; for an encoded step also
each chunk's file and its codec entries, ``commit/flat_encode.py``), a chunk-by-chunk write a
``ChunkRecord`` per chunk. This builds the step's table from both (``manifest.TableBuilder``),
splices a raw flat step's from cached columns (``TableTemplate``), and gives the records
themselves to the callers that need objects (a part's vote, a merge). A ``StepTable`` is
composed into its ``Transaction``, which writes the bytes and, under its lock, records here
where they went. Rejected alternatives: building ``ChunkRecord`` objects for every write —
~3 µs per chunk per step, where the columns cost a list extend; a mixin of the transaction
(one class split across two files, typed by a back-reference to the writer).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dstt.errors import DsttError
from dstt.store.format.flat import FlatLayout
from dstt.store.format.manifest import TableBuilder, TableTemplate, chunk_record, dump_arrays
from dstt.store.format.records import ArrayRecord, ChunkRecord

if TYPE_CHECKING:
    from dstt.store.format.layout import ChunkPlan

__all__ = ["StepTable"]

#: where a flat write's chunks went: offsets, sizes, crc32c (one entry per chunk)
Columns = tuple[list[int], list[int], list[int]]
#: an encoded flat write's chunks: each chunk's file, and codec entries by chunk position
EncodedColumns = tuple[list[str], Mapping[int, Any]]
#: a writer's arrays table template of a layout (``Writer.table_template``)
TemplateOf = Callable[[FlatLayout, Sequence[int] | None], TableTemplate]


class StepTable:
    """What one step holds, as columns (not thread-safe: its transaction locks around it)."""

    def __init__(
        self,
        step: int,
        slot: int,
        zip_key: str,
        dims: Mapping[str, tuple[str, ...] | None],
        template: TemplateOf,
    ) -> None:
        """``zip_key``: the step's own zip (raw chunks' file); ``dims``: the writer's
        dimension names by path; ``template``: its cached table template of a layout."""
        self.step, self.slot, self.zip_key = step, slot, zip_key
        self.dims, self.template = dims, template
        #: path -> (dtype, plan) of every array declared in this step
        self.plans: dict[str, tuple[str, ChunkPlan]] = {}
        #: path -> its chunks' records, written one at a time (``put_chunk``)
        self.chunks: dict[str, list[ChunkRecord | None]] = {}
        #: chunks written by ``put_flat``: per call (offsets, sizes, crc32c), and per array
        #: its span of them — columns, not a record object per chunk
        self.flat: list[Columns] = []
        self.flat_layouts: list[FlatLayout] = []
        #: per ``put_flat`` call of an encoded step: each chunk's file and its codec entries
        #: (by chunk position in the layout); None for a raw one (all in this step's zip)
        self.flat_enc: list[EncodedColumns | None] = []
        #: path -> (flat call, first chunk, end chunk)
        self.flat_span: dict[str, tuple[int, int, int]] = {}

    def declare(self, path: str, dtype: str, plan: ChunkPlan) -> None:
        """An array written chunk by chunk."""
        if path in self.plans:
            raise ValueError(f"array {path!r} declared twice in step {self.step}")
        self.plans[path] = (dtype, plan)
        self.chunks[path] = [None] * plan.n_chunks

    def declare_layout(self, layout: FlatLayout) -> dict[str, tuple[str, ChunkPlan]]:
        plans = layout.plans
        if not self.plans.keys().isdisjoint(plans):
            dup = sorted(self.plans.keys() & plans.keys())
            raise ValueError(f"array {dup[0]!r} declared twice in step {self.step}")
        self.plans.update(plans)
        return plans

    def record_flat(
        self, layout: FlatLayout, cols: Columns, encoded: EncodedColumns | None
    ) -> None:
        """Where a flat write's chunks are (columns) and, encoded, their files and codecs."""
        if encoded is not None:  # (a raw write declared it when it reserved its range)
            self.declare_layout(layout)
        put = len(self.flat)
        self.flat.append(cols)
        self.flat_layouts.append(layout)
        self.flat_enc.append(encoded)
        paths, los, his = layout.span_columns
        self.flat_span.update(
            zip(paths, zip(itertools.repeat(put), los, his, strict=False), strict=True)
        )

    def table(self) -> TableBuilder:
        b = TableBuilder()
        zip_id = b.file_id(self.zip_key)
        ids: list[list[int] | None] = [
            None if e is None else list(map(b.file_id, e[0])) for e in self.flat_enc
        ]
        for path, (dtype, plan) in self.plans.items():
            b.add_array(path, dtype, plan.shape, plan.rows, self.dims.get(path))
            span = self.flat_span.get(path)
            if span is not None:
                put, lo, hi = span
                offs, sizes, crcs = self.flat[put]
                enc, fid = self.flat_enc[put], ids[put]
                if enc is None or fid is None:
                    b.add_chunks(zip_id, offs[lo:hi], sizes[lo:hi], crcs[lo:hi])
                    continue
                first = len(b.offset)
                b.file.extend(fid[lo:hi])
                b.offset.extend(offs[lo:hi])
                b.nbytes.extend(sizes[lo:hi])
                b.crc32c.extend(crcs[lo:hi])
                codecs = enc[1]
                b.codecs.update(
                    (str(first + j - lo), list(codecs[j])) for j in range(lo, hi) if j in codecs
                )
                continue
            for c in self._complete(path):
                b.add_record(c)
        return b

    def table_parts(self) -> tuple[TableTemplate, list[int], list[int]] | None:
        """A step written whole from one flat layout (the hot path): its arrays table as
        the layout's cached fixed columns and this step's offsets and checksums, spliced
        by ``TableTemplate.dump``; None for anything else."""
        if len(self.flat) == 1 and not self.chunks and self.flat_enc[0] is None:
            layout = self.flat_layouts[0]
            offsets, sizes, crcs = self.flat[0]
            if len(self.plans) == len(layout.arrays):
                tpl = self.template(layout, sizes)
                if tpl.sizes == sizes:
                    return tpl, offsets, crcs
        return None

    def arrays_table(self) -> bytes:
        """This step's sealed arrays table (``manifest.dump_arrays``): spliced from cached
        columns where ``table_parts`` has them, else built array by array."""
        parts = self.table_parts()
        if parts is not None:
            return parts[0].dump(self.slot, self.zip_key, parts[1], parts[2])
        if (
            len(self.flat) == 1
            and not self.chunks
            and self.flat_enc[0] is not None
            and len(self.plans) == len(self.flat_layouts[0].arrays)
        ):
            return self._encoded_table()
        return dump_arrays(self.slot, self.table())

    def _encoded_table(self) -> bytes:
        """An encoded step written whole from one flat layout: the layout's cached fixed
        columns spliced with this step's (``TableTemplate.dump_columns``), the same bytes
        ``dump_arrays(slot, self.table())`` makes with Python per array."""
        layout = self.flat_layouts[0]
        offsets, sizes, crcs = self.flat[0]
        enc = self.flat_enc[0]
        assert enc is not None
        keys, codecs = enc
        files = list(dict.fromkeys([self.zip_key, *keys]))  # first appearance, as file_id
        ids = dict(zip(files, range(len(files)), strict=True))
        tpl = self.template(layout, None)
        return tpl.dump_columns(
            self.slot,
            files,
            list(map(ids.__getitem__, keys)),
            sizes,
            offsets,
            crcs,
            dict(zip(map(str, codecs), map(list, codecs.values()), strict=True)),
        )

    def _complete(self, path: str) -> list[ChunkRecord]:
        span = self.flat_span.get(path)
        if span is not None:
            offs, sizes, crcs = self.flat[span[0]]
            enc = self.flat_enc[span[0]]
            if enc is not None:
                return [
                    chunk_record(enc[0][k], offs[k], sizes[k], crcs[k], enc[1].get(k))
                    for k in range(span[1], span[2])
                ]
            return [
                ChunkRecord(self.zip_key, sizes[k], crcs[k], offset=offs[k])
                for k in range(span[1], span[2])
            ]
        chunks = self.chunks[path]
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise DsttError(
                f"step {self.step}: chunks {missing[:8]} of {path!r} were "
                "never written; refusing to commit an incomplete step"
            )
        return chunks  # type: ignore[return-value]

    def records(self) -> dict[str, ArrayRecord]:
        return {
            path: ArrayRecord(
                path, dtype, plan.shape, plan.rows, tuple(self._complete(path)), self.dims.get(path)
            )
            for path, (dtype, plan) in self.plans.items()
        }
