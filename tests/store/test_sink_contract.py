"""``dstt.testing.WriterTests`` run against every ``StepSink`` the engine can write through.

One process (the store's ``Writer``), two real ranks (``RankWriter`` in two spawned gloo
processes, rank 0 merging rank 1's part; the test drives both through a pipe), and the
DeepSpeed tag writer (``_TagWriter``: every flight of a tag shares one transaction). Each runs
with a flusher process of its own, which the flusher case kills mid-step.
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dstt.engine.ds._ds_tags import _Save, _TagWriter
from dstt.store._internal import (
    CommitHeader,
    DeltaPolicy,
    Digest,
    FlatLayout,
    FlatSegment,
    RankInfo,
    RankWriter,
    Repository,
    StepSink,
    StepStats,
    TransactionSink,
    flusher_supported,
)
from dstt.store.flusher.parent import Flusher
from dstt.store.format.flat import byte_view
from dstt.testing import WriterTests
from dstt.testing.writer_tests import ARRAYS, SMALL, flat, values

pytestmark = pytest.mark.skipif(not flusher_supported(), reason="the flusher needs Linux memfd")

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("sink_rank_child.py")
_LEN = struct.Struct("<Q")
REPLY_TIMEOUT = 300.0


# -- one process ---------------------------------------------------------------------------
class TestWriterSink(WriterTests):
    @pytest.fixture
    def sink(self, run_path: Path) -> Iterator[StepSink]:
        writer = Repository.create(run_path).writer(chunk_bytes=256)
        fl = Flusher(1 << 16, 2)
        try:
            yield TransactionSink(writer, fl)
        finally:
            writer.close()
            fl.close()


class TestEncodingWriterSink(WriterTests):
    """The same writer encoding XOR deltas: steps after the first are deltas, written here
    chunk by chunk (the flusher still commits them)."""

    @pytest.fixture
    def sink(self, run_path: Path) -> Iterator[StepSink]:
        policy = DeltaPolicy(raw_when_busy=False, min_ratio=1.0)
        writer = Repository.create(run_path).writer(chunk_bytes=256, encoding=policy)
        fl = Flusher(1 << 16, 2)
        try:
            yield TransactionSink(writer, fl)
        finally:
            writer.close()
            fl.close()


def test_an_encoding_writer_mixes_whole_and_segmented_steps(tmp_path: Path) -> None:
    """Slowly changing steps, whole and in two segments by turns: every one reads back
    bit-exactly and the whole ones after the first are XOR deltas."""
    policy = DeltaPolicy(raw_when_busy=False, min_ratio=1.0)
    writer = Repository.create(tmp_path / "run").writer(chunk_bytes=256, encoding=policy)
    sink = TransactionSink(writer)
    base, datas = values(1, ARRAYS), {}
    try:
        layout = sink.layout(ARRAYS)
        cut = layout.arrays[1].offset
        for step in range(1, 7):
            datas[step] = data = {p: v[:-1] + bytes([step]) for p, v in base.items()}
            buf = bytes(flat(layout, data))
            h = sink.begin(step)
            if step % 2:
                h.write(FlatSegment(layout, 0, buf))
            else:
                h.write(FlatSegment(layout, 0, buf[:cut]))
                h.write(FlatSegment(layout, cut, buf[cut:]))
            h.commit()
    finally:
        writer.close()
    r = Repository.open(tmp_path / "run").reader()
    for h in r.lineage():
        for path, want in datas[h.step].items():
            assert r.read_array(h, path).tobytes() == want, (h.step, path)
        codecs = {c.encoding for a in r.arrays(h).values() for c in a.chunks}
        if h.step in (3, 5):  # (a segmented step is a keyframe today: its staged layout is
            assert codecs != {"raw"}, (h.step, codecs)  # not the whole steps' one)
    assert Repository.open(tmp_path / "run").verify().problems == []


# -- the DeepSpeed tag writer ----------------------------------------------------------------
class _OneFlightTags(dict[int, _Save]):
    """The tag writer's saves: a step not announced is a tag of one flight."""

    def __missing__(self, step: int) -> _Save:
        save = self[step] = _Save(None, step, "main", total=1)  # type: ignore[arg-type]
        return save


def _one_rank(run_path: Path) -> RankWriter:
    w = Repository.create(run_path).writer(chunk_bytes=256)
    return RankWriter(w, RankInfo(0, 1), base_slot=w.next_slot, session="s")


class TestTagSink(WriterTests):
    @pytest.fixture
    def sink(self, run_path: Path) -> Iterator[StepSink]:
        rw = _one_rank(run_path)
        fl = Flusher(1 << 16, 2)
        rw.writer.committer = fl
        try:
            yield TransactionSink(_TagWriter(rw, _OneFlightTags()), fl)
        finally:
            rw.close()
            fl.close()


def test_a_tag_of_two_flights_is_one_commit(tmp_path: Path) -> None:
    """Each flight writes its own arrays into the tag's one transaction; only the final
    flight's commit commits, once, with both."""
    rw = _one_rank(tmp_path / "run")
    saves = {5: _Save(None, 5, "main", total=2)}  # type: ignore[arg-type]
    sink = TransactionSink(_TagWriter(rw, saves))
    try:
        first, second = (("a/x", "float32", (9,)),), (("b/y", "int32", (70,)),)
        data = {}
        for i, arrays in enumerate((first, second)):
            layout = sink.layout(arrays)
            data |= values(5, arrays)
            h = sink.begin(5)
            h.write(FlatSegment(layout, 0, bytes(flat(layout, data))))
            h.put_object(f"file{i}", {"i": i})
            header = h.commit()
            assert (header is None) == (i == 0)
        assert isinstance(header, CommitHeader)
    finally:
        rw.close()
    r = Repository.open(tmp_path / "run").reader()
    assert [h.step for h in r.lineage()] == [5]
    h = r.find(5)
    for path, want in data.items():
        assert r.read_array(h, path).tobytes() == want
    assert r.read_object(h, "file0") == {"i": 0}
    assert r.read_object(h, "file1") == {"i": 1}


# -- two real ranks ----------------------------------------------------------------------------
class _World:
    """Two gloo ranks of ``sink_rank_child.py``; ``call`` sends one command to both and
    returns rank 0's reply (raising the first rank's error)."""

    def __init__(self, logs: Path) -> None:
        with socket.socket() as s:  # a free port for the ranks' rendezvous
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(2):
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
            env.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
            env["MASTER_PORT"] = str(port)
            with open(logs / f"sink.r{rank}.log", "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(CHILD)],
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                    )
                )
        self.logs = logs

    def _reply(self, p: subprocess.Popen[bytes]) -> tuple[Any, ...]:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], REPLY_TIMEOUT)
        head = p.stdout.read(_LEN.size) if ready else b""
        if len(head) < _LEN.size:
            self.close()
            logs = "\n".join(f.read_text(errors="replace") for f in self.logs.glob("sink.r*"))
            raise AssertionError(f"a rank stopped answering:\n{logs[-6000:]}")
        (n,) = _LEN.unpack(head)
        reply: tuple[Any, ...] = pickle.loads(p.stdout.read(n))
        return reply

    def call(self, *cmd: object) -> Any:
        data = pickle.dumps(cmd)
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(_LEN.pack(len(data)) + data)
            p.stdin.flush()
        replies = [self._reply(p) for p in self.procs]
        for kind, value in replies:
            if kind == "err":
                raise pickle.loads(value)
        return replies[0][1]

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    assert p.stdin is not None
                    p.stdin.close()
                    p.wait(60)
                except Exception:
                    p.kill()
                    p.wait()
            for s in (p.stdin, p.stdout):
                if s is not None and not s.closed:
                    s.close()


@dataclass
class _RankHandle:
    world: _World
    hid: int
    step: int

    @property
    def stats(self) -> StepStats:
        return StepStats(0, 0, 0, 0, False)  # (each rank counts its own)

    def write(self, segment: FlatSegment) -> None:
        arrays = tuple((a.path, a.dtype, a.shape) for a in segment.layout.arrays)
        try:
            data = bytes(byte_view(segment.data))
        except ValueError:  # unreadable here: it fails on the ranks too (and raises here)
            self.world.call("write", self.hid, arrays, segment.start, None, False)
            raise AssertionError("a rank wrote an unreadable segment") from None
        shared = segment.shared is not None
        self.world.call("write", self.hid, arrays, segment.start, data, shared)

    def put_object(self, name: str, obj: object) -> None:
        self.world.call("put_object", self.hid, name, obj)

    def commit(self, metrics: Mapping[str, Any] | None = None) -> CommitHeader | None:
        step = self.world.call("commit", self.hid, dict(metrics or {}))
        assert step == self.step
        return Repository.open(self.world.run).reader().find(step)  # type: ignore[attr-defined]

    def abort(self) -> None:
        self.world.call("abort", self.hid)


class _RankSink:
    """A ``StepSink`` whose every call runs on both ranks (rank 1 under ``rank1/`` names)."""

    def __init__(self, world: _World) -> None:
        self.world, self._next = world, 0

    def layout(self, arrays: Any) -> FlatLayout:
        key = tuple((p, d, tuple(s)) for p, d, s in arrays)
        got: FlatLayout = self.world.call("layout", key)
        return got

    def buffers(self, nbytes: int, count: int) -> None:
        return None  # each rank's flusher lends its own (``segment``)

    def close(self) -> None:
        pass

    def begin(
        self, step: int, *, encode: bool = True, keyframe: bool = False, predictions: Any = None
    ) -> _RankHandle:
        self._next += 1
        self.world.call("begin", self._next, step, encode, keyframe)
        return _RankHandle(self.world, self._next, step)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_World]:
    """Two ranks for every case (each case opens a fresh run on them)."""
    w = _World(tmp_path_factory.mktemp("ranks"))
    try:
        yield w
    finally:
        w.close()


class TestTwoRankSink(WriterTests):
    @pytest.fixture
    def sink(self, world: _World, run_path: Path) -> Iterator[StepSink]:
        world.run = run_path  # type: ignore[attr-defined]
        world.call("open", str(run_path))
        try:
            yield _RankSink(world)
        finally:
            world.call("close")

    def segment(self, sink: StepSink, layout: FlatLayout, buf: bytes | bytearray) -> FlatSegment:
        return FlatSegment(layout, 0, bytes(buf), shared=0)  # each rank: its flusher's buffer

    def kill_flusher(self, sink: StepSink) -> None:
        assert isinstance(sink, _RankSink)
        sink.world.call("kill")

    def expected(self, data: Mapping[str, bytes]) -> dict[str, bytes]:
        return {**data, **{f"rank1/{p}": v for p, v in data.items()}}

    def expected_objects(self, objects: Mapping[str, object]) -> dict[str, object]:
        return {**objects, **{f"rank1/{n}": o for n, o in objects.items()}}


def test_the_two_rank_sink_merges_both_ranks(tmp_path: Path) -> None:
    """A guard on the harness itself: rank 1's arrays are in rank 0's commit."""
    w = _World(tmp_path)
    try:
        w.run = tmp_path / "run"  # type: ignore[attr-defined]
        w.call("open", str(tmp_path / "run"))
        sink = _RankSink(w)
        layout = sink.layout(SMALL)
        h = sink.begin(1)
        h.write(FlatSegment(layout, 0, bytes(flat(layout, values(1, SMALL)))))
        h.commit()
        w.call("close")
    finally:
        w.close()
    r = Repository.open(tmp_path / "run").reader()
    assert sorted(r.arrays(r.find(1))) == sorted(
        [p for p, _, _ in SMALL] + [f"rank1/{p}" for p, _, _ in SMALL]
    )
    assert np.array_equal(
        r.read_array(r.find(1), "rank1/params/s"), r.read_array(r.find(1), "params/s")
    )


def test_a_rank_proxy_rewrites_a_reserved_range_here(tmp_path: Path) -> None:
    """What the engine does when the flusher died mid-write — ``put_flat(..., start=)`` into
    the range ``reserve_flat`` gave — through the rank proxy (it dropped ``start`` once)."""
    from dstt.store.format.flat import FlatImage

    rw = _one_rank(tmp_path / "run")
    try:
        layout = rw.flat_layout(SMALL)
        data = values(1, SMALL)
        txn = rw.begin(1)
        start = txn.reserve_flat(layout, lambda s: FlatImage(layout, s, None).nbytes)
        txn.put_flat(layout, flat(layout, data), None, start=start)
        txn.commit()
    finally:
        rw.close()
    r = Repository.open(tmp_path / "run").reader()
    for path, want in data.items():
        assert r.read_array(r.find(1), path).tobytes() == want


@pytest.mark.parametrize("flusher", [True, False], ids=["flusher", "threads"])
def test_a_whole_step_is_digested_where_it_is_written(tmp_path: Path, flusher: bool) -> None:
    """``FlatSegment.digest``: the columns ``write`` returns are the kernel's over the
    step's bytes, taken in the flusher process (from the shared buffer ``buffers`` lent)
    or here, each in its turn (``turn`` before, ``sent`` after)."""
    from dstt.analysis.summary_kernel import DigestPlan, digest

    writer = Repository.create(tmp_path / "run").writer(chunk_bytes=256)
    sink = TransactionSink(writer, start_flusher=flusher)
    try:
        layout = sink.layout(ARRAYS)
        ring = sink.buffers(layout.nbytes, 2)
        assert (ring is not None) == flusher
        a = layout.index()["params/b"]
        probes = np.arange(4, dtype=np.intp)
        plan = DigestPlan([(a.path, np.dtype("int16"), a.offset, 300, probes)], 4)
        calls: list[str] = []
        for step in (1, 2):
            data = values(step, ARRAYS)
            buf = flat(layout, data)
            d = Digest(plan, step - 1, lambda: calls.append("turn"), lambda: calls.append("sent"))
            if ring is not None:
                view = np.frombuffer(ring.buffers[step % 2], np.uint8, count=len(buf))
                view[:] = np.frombuffer(buf, np.uint8)
                seg = FlatSegment(layout, 0, view, shared=step % 2, digest=d)
            else:
                seg = FlatSegment(layout, 0, buf, digest=d)
            h = sink.begin(step)
            got = h.write(seg)
            h.commit()
            fresh = DigestPlan([(a.path, np.dtype("int16"), a.offset, 300, probes)], 4)
            want = digest(fresh, np.frombuffer(flat(layout, data), np.uint8))
            assert got is not None
            for key, value in want.items():
                np.testing.assert_array_equal(got[key], value, err_msg=key)
            assert got["prev_token"] == step - 2  # the step digested before (none: -1)
            TestWriterSink().check(tmp_path / "run", step, data, {})
        assert calls == ["turn", "sent"] * 2
    finally:
        sink.close()
        writer.close()


def test_a_kept_view_finds_the_images_its_address_finds(tmp_path: Path) -> None:
    """The fast path of ``TransactionSink.images``: a view seen before (a ring hands the
    same view of a buffer every step) finds its images by identity — the same dict the
    general path finds by the memory's address — and steps written from it read back."""
    from dstt.store._seam import _bytes

    writer = Repository.create(tmp_path / "run").writer(chunk_bytes=256)
    sink = TransactionSink(writer)
    try:
        layout = sink.layout(ARRAYS)
        mem = bytearray(layout.nbytes + 64)
        kept = memoryview(mem)[: layout.nbytes]
        assert _bytes(kept) is kept
        arr = np.arange(6, dtype=np.int16)
        assert _bytes(arr).tobytes() == byte_view(arr).tobytes()
        assert _bytes(arr).format == "B"
        images = sink.images(kept)
        assert images is not None
        assert sink.images(kept) is images  # by identity
        assert sink.images(memoryview(mem)[: layout.nbytes]) is images  # by address
        assert sink.images(memoryview(mem)[: layout.nbytes - 8]) is not images
        for step in (1, 2, 3):
            data = values(step, ARRAYS)
            kept[:] = flat(layout, data)
            h = sink.begin(step)
            h.write(FlatSegment(layout, 0, kept))
            h.commit()
            TestWriterSink().check(tmp_path / "run", step, data, {})
    finally:
        sink.close()
        writer.close()
