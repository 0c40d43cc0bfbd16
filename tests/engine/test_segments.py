"""A state larger than the budget is captured in segments of its one flat layout.

One lane: a step larger than half of ``budget_bytes`` is copied and written as contiguous byte
ranges of its ``FlatLayout`` (``flatlane.segments``), each through a buffer of the same ring.
Checked here: the cut itself (chunk boundaries, every chunk once, within the buffer), that the
stored steps are bit for bit those of a run whose steps fit whole, that a resume from them
continues bit-exactly, that host memory stays within the budget, and verify mode on segments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dstt.engine.capture.flatlane import segments
from dstt.errors import CaptureError, ConfigError, RaceError
from dstt.store import DeltaPolicy, Repository
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, same_bits, stored, train_step

D = 64  # l1.weight 64x64 fp32 = 16 KiB; with AdamW the state is ~70 KiB
TINY = 16 * 1024  # two buffers of 8 KiB: every step in segments, l1.weight split
STEPS = 4


def _train(run: Path, steps: int, *, resume: bool = False, **kw: object) -> list:
    torch.manual_seed(0)
    m = MLP(d_in=D, hidden=D)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with session(m, opt, run=run, resume=resume, **kw) as s:
        first = s.step
        for i in range(first, first + steps):
            train_step(m, opt, *mlp_batch(i, d_in=D))
        pipe = s._pipeline
    assert pipe is not None
    assert pipe.steps is not None
    return [s.metrics, pipe.steps]


def _arrays(repo: Repository, step: int) -> dict[str, torch.Tensor]:
    r = repo.reader()
    return {p: stored(repo, step, p) for p in r.arrays(r.find(step))}


def test_segments_cut_the_layout_at_chunk_boundaries(tmp_path: Path) -> None:
    w = Repository.create(tmp_path / "run").writer(chunk_bytes=4096)
    try:
        layout = w.flat_layout(
            [("x/a", "float32", (64, 64)), ("x/b", "float32", (3,)), ("x/d", "int64", (700,))]
        )
    finally:
        w.close()
    for nbytes in (4096, 6000, 9000, 1 << 20):
        segs = segments(layout, nbytes)
        assert [c for g in segs for c in range(g.lo, g.hi)] == list(range(len(layout.chunks)))
        for g in segs:
            assert g.stop - g.start <= nbytes
            assert (g.start, g.stop) == (layout.chunks[g.lo][2], layout.chunks[g.hi - 1][3])
            # the parts are exactly the chunks' bytes, array by array
            covered = sum(hi - lo for _, lo, hi in g.parts)
            assert covered == sum(c[3] - c[2] for c in layout.chunks[g.lo : g.hi])
    assert len(segments(layout, 4096)) > 4  # "x/a" (16 KiB) alone takes four
    assert len(segments(layout, 1 << 20)) == 1
    with pytest.raises(CaptureError, match="raise budget_bytes"):
        segments(layout, 1000)


@pytest.mark.parametrize("encoding", [None, DeltaPolicy(raw_when_busy=False)], ids=["raw", "enc"])
def test_segmented_steps_store_the_same_bits_as_whole_ones(
    tmp_path: Path, encoding: DeltaPolicy | None
) -> None:
    whole_m, whole_ring = _train(tmp_path / "whole", STEPS, encoding=encoding)
    seg_m, seg_ring = _train(tmp_path / "seg", STEPS, encoding=encoding, budget_bytes=TINY)
    assert all(x.bytes <= whole_ring.nbytes for x in whole_m)  # the reference: whole steps
    assert all(x.bytes > 2 * seg_ring.nbytes for x in seg_m)  # several segments each
    # the ring never grows past the budget, whatever the step's size
    assert seg_ring.capacity <= TINY
    assert all(x.cache_peak_bytes <= x.cache_capacity <= TINY for x in seg_m)
    a, b = Repository.open(tmp_path / "whole"), Repository.open(tmp_path / "seg")
    assert committed_steps(a) == committed_steps(b) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        want, got = _arrays(a, step), _arrays(b, step)
        assert sorted(want) == sorted(got)
        for path, t in want.items():
            assert same_bits(got[path], t), (step, path)
    assert b.verify().problems == []


def test_a_resume_from_segmented_steps_continues_bit_exactly(tmp_path: Path) -> None:
    _train(tmp_path / "straight", STEPS + 2)
    _train(tmp_path / "seg", STEPS, budget_bytes=TINY)
    _train(tmp_path / "seg", 2, resume=True, budget_bytes=TINY)
    a, b = Repository.open(tmp_path / "straight"), Repository.open(tmp_path / "seg")
    assert committed_steps(b) == list(range(1, STEPS + 3))
    for step in (STEPS, STEPS + 1, STEPS + 2):
        want, got = _arrays(a, step), _arrays(b, step)
        for path, t in want.items():
            assert same_bits(got[path], t), (step, path)


def test_verify_mode_checks_the_copy_of_every_segment(tmp_path: Path) -> None:
    _train(tmp_path / "run", 3, verify=True, budget_bytes=TINY)
    assert committed_steps(Repository.open(tmp_path / "run")) == [1, 2, 3]
    # a .data write after stage bypasses the version counter; verify sees the sums differ
    m = MLP(d_in=D, hidden=D)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    armed = [False]

    def hook(mod: torch.nn.Module, args: object) -> None:
        if armed[0]:
            armed[0] = False
            mod.weight.data.add_(0.5)

    m.l1.register_forward_pre_hook(hook)
    with (
        pytest.raises(RaceError, match=r"params/l1/weight"),
        session(m, opt, run=tmp_path / "race", verify=True, budget_bytes=TINY),
    ):
        train_step(m, opt, *mlp_batch(0, d_in=D))
        armed[0] = True
        train_step(m, opt, *mlp_batch(1, d_in=D))
    assert committed_steps(Repository.open(tmp_path / "race")) == []


def test_a_writer_without_flat_layout_is_refused(tmp_path: Path) -> None:
    from dstt.engine.capture.pipeline import Pipeline

    class NoLayout:
        encoder = None

        def begin(self, step: int) -> None:
            raise AssertionError("never reached")

    with pytest.raises(ConfigError, match="flat_layout"):
        Pipeline(NoLayout(), budget_bytes=1 << 20)  # type: ignore[arg-type]


def test_a_race_in_a_segmented_step_is_refused_not_stored_mixed(tmp_path: Path) -> None:
    """race_policy="recopy": a segmented step's segments are written as they are copied, so
    a race found afterwards cannot be recopied (a chunk is written once); that step is
    dropped with a RaceError that says so and what to do, the steps before it stay."""
    torch.manual_seed(0)
    m = MLP(d_in=D, hidden=D)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    armed = [False]

    def hook(mod: torch.nn.Module, args: object) -> None:
        if armed[0]:
            armed[0] = False
            with torch.no_grad():
                mod.weight.add_(0.5)  # in place, in step 1's copy window

    m.l1.register_forward_pre_hook(hook)
    run = tmp_path / "run"
    with (
        pytest.raises(RaceError, match=r"step 1: params/l1/weight .* raise budget_bytes"),
        session(m, opt, run=run, budget_bytes=TINY, race_policy="recopy"),
    ):
        train_step(m, opt, *mlp_batch(0, d_in=D))
        armed[0] = True
        train_step(m, opt, *mlp_batch(1, d_in=D))
        train_step(m, opt, *mlp_batch(2, d_in=D))
    repo = Repository.open(run)
    assert committed_steps(repo) == [2]  # step 1 dropped whole, never stored mixed
    assert repo.verify().problems == []
