"""A shipped contract test for ``StepSink`` implementations (the engine → store seam).

Every writer must keep ``_seam.py``'s contract: commits read back bit-exactly and in order, aborted
steps stay invisible, objects round-trip, bad segments raise ``SegmentError``, a flusher dying
mid-step loses nothing. Subclass :class:`WriterTests` with a ``sink`` fixture on ``run_path``::

    class TestMySink(WriterTests):
        @pytest.fixture
        def sink(self, run_path):
            return TransactionSink(Repository.create(run_path).writer(chunk_bytes=256))

After zarr's ``StoreTests``. Rejected: a contract test per implementation (they drift).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
import pytest

from dstt.errors import CaptureError, SegmentError
from dstt.store._internal import (
    CommitHeader,
    FlatLayout,
    FlatSegment,
    Repository,
    StepHandle,
    StepSink,
    TransactionSink,
)

if TYPE_CHECKING:
    from collections.abc import Mapping
    from pathlib import Path

__all__ = ["WriterTests"]

#: a step's arrays: two that span several chunks (at 256-byte chunks) and a scalar
ARRAYS = (
    ("params/w", "float32", (12, 10)),
    ("params/b", "int16", (300,)),
    ("optim/t", "int64", ()),
)
#: arrays of one chunk each: the flat layout frames them in place (``flat.py``)
SMALL = (("params/s", "float32", (7,)), ("params/u", "uint8", (5,)))


def values(step: int, arrays: tuple[tuple[str, str, tuple[int, ...]], ...]) -> dict[str, bytes]:
    """Each array's bytes at ``step``: a pure function of (step, path)."""
    out = {}
    for k, (path, dtype, shape) in enumerate(arrays):
        rng = np.random.default_rng(1000 * step + k)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        out[path] = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return out


def flat(layout: FlatLayout, data: Mapping[str, bytes]) -> bytearray:
    """A step buffer laid out by ``layout`` holding ``data``."""
    buf = bytearray(layout.nbytes)
    for a in layout.arrays:
        buf[a.offset : a.offset + a.nbytes] = data[a.path]
    return buf


class WriterTests:
    """The contract every ``StepSink`` keeps (see the module docstring)."""

    @pytest.fixture
    def run_path(self, tmp_path: Path) -> Path:
        return tmp_path / "run"

    @pytest.fixture
    def sink(self, run_path: Path) -> StepSink:  # pragma: no cover - overridden
        raise NotImplementedError("give WriterTests a `sink` fixture writing to `run_path`")

    # -- hooks an implementation may override -------------------------------------------------
    def segment(self, sink: StepSink, layout: FlatLayout, buf: bytes | bytearray) -> FlatSegment:
        """A whole step as a segment: in a shared buffer where the sink lends them."""
        ring = sink.buffers(len(buf), 2)
        if ring is None:
            return FlatSegment(layout, 0, bytes(buf))
        self._ring = i = (getattr(self, "_ring", -1) + 1) % len(ring.buffers)
        view = np.frombuffer(ring.buffers[i], dtype=np.uint8, count=len(buf))
        view[:] = np.frombuffer(buf, dtype=np.uint8)
        return FlatSegment(layout, 0, view, shared=i)

    def kill_flusher(self, sink: StepSink) -> None:
        """Kill the sink's flusher process (every rank's) and wait until it is gone."""
        fl = sink.flusher if isinstance(sink, TransactionSink) else None
        assert fl is not None, "this sink has no flusher to kill"
        assert fl.proc is not None
        fl.proc.kill()
        fl.proc.wait(60)

    def expected(self, data: Mapping[str, bytes]) -> dict[str, bytes]:
        """What a step holds for ``data`` written through the sink (several ranks: more)."""
        return dict(data)

    def expected_objects(self, objects: Mapping[str, object]) -> dict[str, object]:
        return dict(objects)

    # -- helpers -----------------------------------------------------------------------------
    def check(
        self, run_path: Path, step: int, data: Mapping[str, bytes], objects: Mapping[str, object]
    ) -> None:
        r = Repository.open(run_path).reader()
        h = r.find(step)
        assert set(r.arrays(h)) == set(self.expected(data)), step
        for path, want in self.expected(data).items():
            got = r.read_array(h, path)
            assert got.tobytes() == want, (step, path)
        for name, obj in self.expected_objects(objects).items():
            assert r.read_object(h, name) == obj, (step, name)

    def steps(self, run_path: Path) -> list[int]:
        return [h.step for h in Repository.open(run_path).reader().lineage()]

    def commit_step(
        self, sink: StepSink, step: int, arrays: tuple[tuple[str, str, tuple[int, ...]], ...]
    ) -> dict[str, bytes]:
        layout = sink.layout(arrays)
        data = values(step, arrays)
        h = sink.begin(step)
        assert isinstance(h, StepHandle)  # the whole seam, as the Protocol names it
        assert h.step == step
        h.write(self.segment(sink, layout, flat(layout, data)))
        h.put_object("meta", {"step": step})
        got = h.commit({"loss": float(step)})
        assert got is None or (isinstance(got, CommitHeader) and got.step == step)
        return data

    # -- the contract --------------------------------------------------------------------------
    @pytest.mark.parametrize("arrays", [ARRAYS, SMALL], ids=["chunked", "framed"])
    def test_a_committed_step_reads_back_bit_exactly(
        self,
        sink: StepSink,
        run_path: Path,
        arrays: tuple[tuple[str, str, tuple[int, ...]], ...],
    ) -> None:
        for step in (1, 2):
            data = self.commit_step(sink, step, arrays)
            self.check(run_path, step, data, {"meta": {"step": step}})
        assert self.steps(run_path) == [1, 2]

    @pytest.mark.parametrize("arrays", [ARRAYS, SMALL], ids=["chunked", "framed"])
    def test_a_step_written_in_segments_reads_back_bit_exactly(
        self,
        sink: StepSink,
        run_path: Path,
        arrays: tuple[tuple[str, str, tuple[int, ...]], ...],
    ) -> None:
        layout = sink.layout(arrays)
        data = values(3, arrays)
        buf = flat(layout, data)
        cut = layout.arrays[1].offset  # between the first array and the rest
        h = sink.begin(3)
        h.write(FlatSegment(layout, 0, bytes(buf[:cut])))
        h.write(FlatSegment(layout, cut, bytes(buf[cut:])))
        h.commit()
        self.check(run_path, 3, data, {})

    def test_a_step_cut_inside_arrays_at_chunk_boundaries_reads_back(
        self, sink: StepSink, run_path: Path
    ) -> None:
        """Segments may cut an array between its chunks (a state larger than a buffer)."""
        layout = sink.layout(ARRAYS)
        spans = {p: (lo, hi) for p, lo, hi in layout.spans}
        lo, hi = spans["params/w"]
        assert hi - lo > 1, "the test needs an array of several chunks"
        cuts = [layout.chunks[lo + 1][2], layout.chunks[spans["params/b"][0] + 1][2]]
        for step in (1, 2):  # the second: against the first, where the sink encodes
            data = values(step, ARRAYS)
            buf = flat(layout, data)
            h = sink.begin(step)
            for a, b in zip([0, *cuts], [*cuts, layout.nbytes], strict=True):
                h.write(FlatSegment(layout, a, bytes(buf[a:b])))
            h.put_object("meta", {"step": step})
            h.commit()
            self.check(run_path, step, data, {"meta": {"step": step}})
        assert Repository.open(run_path).verify().problems == []

    def test_a_segment_cutting_a_chunk_is_refused(self, sink: StepSink, run_path: Path) -> None:
        layout = sink.layout(ARRAYS)
        data = values(1, ARRAYS)
        buf = flat(layout, data)
        mid = layout.chunks[0][2] + 4  # inside the first chunk
        h = sink.begin(1)
        with pytest.raises(SegmentError, match="splits a chunk of array 'params/w'"):
            h.write(FlatSegment(layout, 0, bytes(buf[:mid])))
        with pytest.raises(SegmentError, match="outside"):
            h.write(FlatSegment(layout, layout.nbytes - 4, bytes(8)))
        h.write(FlatSegment(layout, 0, bytes(buf)))  # a refusal wrote nothing
        h.commit()
        self.check(run_path, 1, data, {})

    def test_abort_leaves_nothing_visible(self, sink: StepSink, run_path: Path) -> None:
        layout = sink.layout(ARRAYS)
        h = sink.begin(1)
        h.write(self.segment(sink, layout, flat(layout, values(1, ARRAYS))))
        h.put_object("meta", {"step": 1})
        h.abort()
        h.abort()  # idempotent
        with pytest.raises(CaptureError, match="aborted"):
            h.commit()
        assert Repository.open(run_path).reader().head() is None
        data = self.commit_step(sink, 2, ARRAYS)
        assert self.steps(run_path) == [2]
        self.check(run_path, 2, data, {"meta": {"step": 2}})

    def test_an_exception_mid_write_leaves_no_step_and_the_next_commits(
        self, sink: StepSink, run_path: Path
    ) -> None:
        first = self.commit_step(sink, 1, ARRAYS)
        layout = sink.layout(ARRAYS)
        buf = flat(layout, values(2, ARRAYS))
        cut = layout.arrays[1].offset
        broken = memoryview(bytearray(buf[cut:]))
        broken.release()  # reading it fails: as a device copy that fails mid-step
        h = sink.begin(2)
        h.write(FlatSegment(layout, 0, bytes(buf[:cut])))
        with pytest.raises(ValueError, match="released"):
            h.write(FlatSegment(layout, cut, broken))
        with pytest.raises(CaptureError, match="abort it"):
            h.commit()
        h.abort()
        assert self.steps(run_path) == [1]
        data = self.commit_step(sink, 3, ARRAYS)
        assert self.steps(run_path) == [1, 3]
        self.check(run_path, 1, first, {"meta": {"step": 1}})
        self.check(run_path, 3, data, {"meta": {"step": 3}})

    def test_objects_round_trip(self, sink: StepSink, run_path: Path) -> None:
        objects: dict[str, object] = {
            "rng/state": {"seed": 7, "pos": [1, 2, 3]},
            "note": "a string",
            "lr": 3e-4,
            "tags": ["a", None, True],
        }
        layout = sink.layout(SMALL)
        data = values(1, SMALL)
        h = sink.begin(1)
        for name, obj in objects.items():
            h.put_object(name, obj)
        h.write(self.segment(sink, layout, flat(layout, data)))
        h.commit()
        self.check(run_path, 1, data, objects)

    def test_steps_in_flight_land_in_commit_order(self, sink: StepSink, run_path: Path) -> None:
        layout = sink.layout(ARRAYS)
        handles = [sink.begin(step) for step in (1, 2, 3)]
        data = {h.step: values(h.step, ARRAYS) for h in handles}
        for h in reversed(handles):  # written in any order; committed in begin order
            h.write(FlatSegment(layout, 0, bytes(flat(layout, data[h.step]))))
        for h in handles:
            h.commit({"loss": float(h.step)})
            assert self.steps(run_path)[-1] == h.step
        assert self.steps(run_path) == [1, 2, 3]
        for step, d in data.items():
            self.check(run_path, step, d, {})

    def test_segments_out_of_order_or_overlapping_are_refused(
        self, sink: StepSink, run_path: Path
    ) -> None:
        layout = sink.layout(ARRAYS)
        data = values(1, ARRAYS)
        buf = flat(layout, data)
        a, b = layout.arrays[1].offset, layout.arrays[2].offset
        h = sink.begin(1)
        h.write(FlatSegment(layout, a, bytes(buf[a:b])))
        with pytest.raises(SegmentError, match="byte order"):
            h.write(FlatSegment(layout, 0, bytes(buf[:a])))  # before what was written
        with pytest.raises(SegmentError, match="byte order"):
            h.write(FlatSegment(layout, a, bytes(buf[a:])))  # over what was written
        with pytest.raises(SegmentError, match="splits a chunk"):
            h.write(FlatSegment(layout, b + 4, bytes(buf[b + 4 :])))
        with pytest.raises(SegmentError, match="another layout"):
            h.write(FlatSegment(sink.layout(SMALL), 0, bytes(layout.nbytes)))
        with pytest.raises(SegmentError, match="unwritten"):
            h.commit()  # the first array is missing: never a partial step
        h.abort()
        assert Repository.open(run_path).reader().head() is None
        h = sink.begin(2)
        h.write(FlatSegment(layout, 0, bytes(buf[:a])))
        with pytest.raises(SegmentError, match="byte order"):
            h.write(FlatSegment(layout, 0, bytes(buf[:a])))  # the same range twice
        h.write(FlatSegment(layout, a, bytes(buf[a:])))  # a refusal wrote nothing
        h.commit()
        assert self.steps(run_path) == [2]
        self.check(run_path, 2, data, {})

    @pytest.mark.filterwarnings("ignore:dstt. the flusher process died:RuntimeWarning")
    def test_a_flusher_that_dies_mid_step_loses_nothing_committed(
        self, sink: StepSink, run_path: Path
    ) -> None:
        """Step 1 goes through the flusher; it is killed between step 2's write (done
        there) and its commit (then done here); step 3 is written here from the start."""
        first = self.commit_step(sink, 1, ARRAYS)
        layout = sink.layout(ARRAYS)
        data = values(2, ARRAYS)
        h = sink.begin(2)
        h.write(self.segment(sink, layout, flat(layout, data)))
        h.put_object("meta", {"step": 2})
        self.kill_flusher(sink)
        h.commit({"loss": 2.0})
        third = self.commit_step(sink, 3, ARRAYS)
        assert self.steps(run_path) == [1, 2, 3]
        for step, d in zip(itertools.count(1), (first, data, third), strict=False):
            self.check(run_path, step, d, {"meta": {"step": step}})
        assert Repository.open(run_path).verify().problems == []
