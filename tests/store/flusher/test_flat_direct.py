"""A framed flat layout: the step buffer is the step file's bytes (zip headers between the
tensors, data 64-byte aligned), written in one piece — whole 4 KiB blocks with O_DIRECT."""

from __future__ import annotations

import errno
import io
import mmap
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dstt.analysis import summary_kernel
from dstt.analysis.summary_kernel import DigestPlan, digest
from dstt.store.flusher import child as flusher_mod
from dstt.store.format.flat import FlatImage, FlatLayout
from dstt.store.format.layout import plan_chunks
from dstt.store.format.zipfmt import end_records

SPECS = [
    ((3, 5), "float32"),
    ((7,), "float16"),
    ((), "int64"),
    ((0,), "float32"),
    ((300, 40), "float32"),
    ((9,), "float32"),
]


def _layout(chunk_bytes: int = 16 << 20) -> tuple[FlatLayout, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    arrays, values = [], {}
    for i, (shape, dt) in enumerate(SPECS):
        path = f"params/l{i}/w"
        arrays.append((path, dt, plan_chunks(shape, np.dtype(dt).itemsize, chunk_bytes)))
        values[path] = (rng.standard_normal(shape) * (i + 1)).astype(dt)
    return FlatLayout.build(arrays), values


def _fill(layout: FlatLayout, values: dict[str, np.ndarray]) -> mmap.mmap:
    buf = mmap.mmap(-1, max(layout.nbytes, 1))
    for a in layout.arrays:
        buf[a.offset : a.offset + a.nbytes] = values[a.path].tobytes()
    return buf


def _typed(items: list[tuple]) -> list[tuple]:
    """The kernel's plan items: the store dtype name as a numpy dtype."""
    return [(p, np.dtype(dt), *rest) for p, dt, *rest in items]


def _large_members(plan: DigestPlan) -> bool:
    """Whether every region's members are summed one by one (none in reduceat runs)."""
    return all(not r.segs.runs for r in plan.regions if len(r.segs.full))


def _as_zip(image: FlatImage, body: bytes) -> bytes:
    cd = bytes(image.directory)
    return body + cd + end_records(image.count, len(cd), len(body))


def test_single_chunk_arrays_are_framed_and_the_buffer_is_the_file() -> None:
    layout, values = _layout()
    assert layout.framed
    assert all(a.offset % 64 == 0 for a in layout.arrays if a.nbytes)
    buf = _fill(layout, values)
    image = FlatImage(layout, 0, memoryview(buf))
    assert image.inplace
    assert len(image.iov) == 1
    crcs, _ = image.fill()
    with zipfile.ZipFile(io.BytesIO(_as_zip(image, bytes(image.iov[0])))) as z:
        assert z.testzip() is None
        for k, _, _, _, name, _ in layout.chunks:
            raw = z.read(name)  # the tensor's bytes, then its crc32c
            assert raw[:-4] == values[layout.arrays[k].path].tobytes()
    assert len(crcs) == len(layout.chunks) == len(SPECS) - 1  # the empty array has no entry


def test_a_multi_chunk_array_keeps_the_gathered_layout() -> None:
    layout, values = _layout(chunk_bytes=4096)  # the 300 x 40 array splits
    assert not layout.framed
    image = FlatImage(layout, 0, memoryview(_fill(layout, values)))
    assert not image.inplace
    image.fill()
    body = b"".join(bytes(v) for v in image.iov)
    with zipfile.ZipFile(io.BytesIO(_as_zip(image, body))) as z:
        assert z.testzip() is None


def test_digest_ignores_the_zip_headers_between_tensors() -> None:
    layout, values = _layout()
    buf = _fill(layout, values)
    FlatImage(layout, 0, memoryview(buf)).fill()  # headers and trailers now sit in the gaps
    items = [
        (
            a.path,
            a.dtype,
            a.offset,
            int(np.prod(a.shape, dtype=np.int64)),
            np.arange(min(3, int(np.prod(a.shape, dtype=np.int64)))),
        )
        for a in layout.arrays
        if a.dtype.startswith("float")
    ]
    got = digest(DigestPlan(_typed(items), 3), np.frombuffer(buf, np.uint8))
    for j, (path, *_rest) in enumerate(items):
        x = values[path].astype(np.float64).ravel()
        want = float(np.abs(x).max()) if x.size else 0.0
        assert got["maxabs"][j] == pytest.approx(want, rel=1e-3), path
        assert got["sumsq"][j] == pytest.approx(float(x @ x), rel=1e-3), path


@pytest.mark.parametrize("large", [1, 1 << 30], ids=["per-tensor", "reduceat"])
def test_digest_is_exact_either_way_it_sums(monkeypatch: pytest.MonkeyPatch, large: int) -> None:
    """Both ways of summing squares (a fused sum per tensor, in blocks of BLOCK elements;
    or reduceat over the whole region) agree with float64, never read past a tensor into
    the headers after it, and count NaN/Inf exactly (the float64 fallback)."""
    monkeypatch.setattr(summary_kernel, "LARGE", large)
    monkeypatch.setattr(summary_kernel, "BLOCK", 100)  # several blocks per tensor, a partial last
    layout, values = _layout()
    values["params/l5/w"][[1, 4]] = [np.nan, np.inf]  # the (9,) float32 tensor
    buf = _fill(layout, values)
    FlatImage(layout, 0, memoryview(buf)).fill()
    items = [
        (a.path, a.dtype, a.offset, int(np.prod(a.shape, dtype=np.int64)), np.arange(0))
        for a in layout.arrays
        if a.dtype == "float32"
    ]
    plan = DigestPlan(_typed(items), 2)
    assert _large_members(plan) == (large == 1)
    exact: list[int] = []
    real = summary_kernel._exact
    monkeypatch.setattr(
        summary_kernel, "_exact", lambda seg: (exact.append(len(seg)), real(seg))[1]
    )
    got = digest(plan, np.frombuffer(buf, np.uint8))
    # only the tensor with NaN/Inf takes the float64 pass (a sum that read past its
    # tensor into the next header would be sent there too, or be wrong)
    assert exact == [9]  # the (9,) tensor's elements
    for j, (path, *_rest) in enumerate(items):
        x = values[path].astype(np.float64).ravel()
        good = x[np.isfinite(x)]
        assert got["sumsq"][j] == pytest.approx(float(good @ good), rel=1e-6), path
        assert got["maxabs"][j] == (float(np.abs(good).max()) if good.size else 0.0), path
        assert (got["finite"][j], got["nan"][j], got["inf"][j]) == (
            good.size,
            int(np.isnan(x).sum()),
            int(np.isinf(x).sum()),
        ), path


def test_whole_blocks_go_with_o_direct_and_the_bytes_are_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, values = _layout()
    buf = _fill(layout, values)
    image = FlatImage(layout, 0, memoryview(buf))
    image.fill()
    want = bytes(image.iov[0])
    assert len(want) > 4096  # some whole blocks, and a tail
    flags: list[int] = []
    real_open = os.open

    def spy(path: str, f: int, *a: int) -> int:
        flags.append(f)
        return real_open(path, f, *a)

    monkeypatch.setattr(flusher_mod.os, "open", spy)
    out = tmp_path / "step.zip"
    out.write_bytes(b"")
    direct = [True]
    flusher_mod._write_image(str(out), image, 0, direct)
    assert out.read_bytes() == want
    assert [bool(f & os.O_DIRECT) for f in flags] == [True, False]
    assert direct == [True]


def test_a_filesystem_without_o_direct_falls_back_to_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, values = _layout()
    image = FlatImage(layout, 0, memoryview(_fill(layout, values)))
    image.fill()
    real_open = os.open

    def no_direct(path: str, f: int, *a: int) -> int:
        if f & os.O_DIRECT:
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, f, *a)

    monkeypatch.setattr(flusher_mod.os, "open", no_direct)
    out = tmp_path / "step.zip"
    out.write_bytes(b"")
    direct = [True]
    flusher_mod._write_image(str(out), image, 0, direct)
    assert out.read_bytes() == bytes(image.iov[0])
    assert direct == [False]


def test_rebinding_restores_headers_another_layout_overwrote() -> None:
    layout, values = _layout()
    buf = _fill(layout, values)
    image = FlatImage(layout, 0, memoryview(buf))
    image.fill()
    first = bytes(image.iov[0])
    buf[: layout.nbytes] = b"\xff" * layout.nbytes  # another layout used the buffer
    for a in layout.arrays:
        buf[a.offset : a.offset + a.nbytes] = values[a.path].tobytes()
    image.bind(memoryview(buf))
    image.fill()
    assert bytes(image.iov[0]) == first


@pytest.mark.parametrize("large", [1, 1 << 30], ids=["per-tensor", "reduceat"])
def test_digest_updates_are_exact_against_the_previous_digested_step(
    monkeypatch: pytest.MonkeyPatch, large: int
) -> None:
    """With a token, a digest sums each tensor's squared change since the previous digest of
    the plan (float16 and float32 regions, zip headers between tensors; either way it sums),
    says whose copy it compared with, and keeps its own; a change it cannot state finitely
    is NaN."""
    monkeypatch.setattr(summary_kernel, "LARGE", large)
    monkeypatch.setattr(summary_kernel, "BLOCK", 100)  # several blocks per tensor
    layout, before = _layout()
    rng = np.random.default_rng(3)
    after = {
        p: (v + (0.01 * rng.standard_normal(v.shape)).astype(v.dtype) if v.dtype.kind == "f" else v)
        for p, v in before.items()
    }
    after["params/l5/w"][2] = np.nan  # the (9,) float32 tensor
    items = [
        (a.path, a.dtype, a.offset, int(np.prod(a.shape, dtype=np.int64)), np.arange(0))
        for a in layout.arrays
        if a.dtype.startswith("float")
    ]
    plan = DigestPlan(_typed(items), 2)
    assert _large_members(plan) == (large == 1)
    bufs = []
    for values in (before, after):
        buf = _fill(layout, values)
        FlatImage(layout, 0, memoryview(buf)).fill()
        bufs.append(buf)
    first = digest(plan, np.frombuffer(bufs[0], np.uint8), 7)
    assert first["prev_token"] == -1
    assert np.isnan(first["upd_sumsq"]).all()
    assert "upd_sumsq" not in digest(plan, np.frombuffer(bufs[1], np.uint8))  # no token
    # the flusher gets the plan pickled: no copy travels with it
    fresh = pickle.loads(pickle.dumps(plan))
    assert digest(fresh, np.frombuffer(bufs[1], np.uint8), 8)["prev_token"] == -1
    got = digest(plan, np.frombuffer(bufs[1], np.uint8), 8)
    assert got["prev_token"] == 7
    for j, (path, *_rest) in enumerate(items):
        d = after[path].astype(np.float64).ravel() - before[path].astype(np.float64).ravel()
        if not np.isfinite(d).all() or d.size == 0:  # (an empty tensor has no update)
            assert np.isnan(got["upd_sumsq"][j]), path
            continue
        assert got["upd_sumsq"][j] == pytest.approx(float(d @ d), rel=1e-6, abs=0.0), path
        assert got["upd_sumsq"][j] > 0, path
    again = digest(plan, np.frombuffer(bufs[1], np.uint8), 9)  # unchanged since 8: zero
    assert again["prev_token"] == 8
    finite = [j for j, (p, _, _, n, _) in enumerate(items) if p != "params/l5/w" and n]
    assert (again["upd_sumsq"][finite] == 0).all()
