"""The reference writers of ``bench/hotpath_bench.py`` do the work they are named for: a
floor that skipped some of it would make dstt look slow against it for no reason."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import crc32c
import pytest
import torch
from isal import isal_zlib

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from _writers import BareWriter, GuardedWriter


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randn(5, 7, generator=g),
        torch.randn(129, generator=g) * 3,
        torch.full((16,), -2.5),
    ]


def test_bare_writer_writes_the_copied_tensors(tmp_path: Path) -> None:
    ts = _tensors()
    bw = BareWriter(ts, tmp_path / "bare.bin")
    try:
        bw.save()
        bw.drain()
    finally:
        bw.close()
    raw = (tmp_path / "bare.bin").read_bytes()
    assert len(raw) == bw.nbytes
    for t, o in zip(ts, bw.offsets, strict=True):
        n = t.numel() * 4
        assert raw[o : o + n] == t.numpy().tobytes()


def test_guarded_writer_checksums_summarizes_and_keeps_two_steps(tmp_path: Path) -> None:
    ts = _tensors()
    gw = GuardedWriter(ts, tmp_path / "bare.bin")
    try:
        for _ in range(4):
            ts[0].add_(1.0)  # a new state every step
            gw.save()
            gw.drain()
    finally:
        gw.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-2.bin",
        "step-2.json",
        "step-3.bin",
        "step-3.json",
    ]
    man = json.loads((tmp_path / "step-3.json").read_text())
    raw = (tmp_path / "step-3.bin").read_bytes()
    assert man["step"] == 3
    for i, (t, o) in enumerate(zip(ts, gw.offsets, strict=True)):
        data = t.numpy().tobytes()
        assert raw[o : o + len(data)] == data
        assert man["crc32c"][i] == crc32c.crc32c(data)
        assert man["crc32"][i] == isal_zlib.crc32(data)
        x = t.double()
        assert man["sumsq"][i] == pytest.approx(float((x * x).sum()), rel=1e-5)
        assert man["max"][i] == float(t.max())
        assert man["min"][i] == float(t.min())
    assert man["min"][2] == man["max"][2] == -2.5  # a constant tensor


def test_guarded_writer_refuses_what_it_cannot_summarize(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="float32"):
        GuardedWriter([torch.zeros(3, dtype=torch.float64)], tmp_path / "x.bin")
