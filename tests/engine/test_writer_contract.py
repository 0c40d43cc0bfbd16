"""One contract for every writer the capture pipeline talks to.

The pipeline drives a store ``Writer`` in a single-rank session, a ``RankWriter`` (through its
``RankTransaction`` proxies) under torch.distributed or DeepSpeed, and the DeepSpeed checkpoint
engine's tag writer. They must behave alike: the same steps committed bit-exactly, whole or in
segments, and the same encoding decisions. A proxy that drops an
attribute the pipeline reads (``encoder`` once: a one-rank DeltaPolicy run then wrote every
step raw) fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dstt.engine.capture.flatlane import FlatPlan
from dstt.engine.capture.pipeline import Pipeline
from dstt.engine.distributed.ranks import RankInfo, open_ranks
from dstt.store._internal import (
    DeltaPolicy,
    FlatStepWriter,
    Repository,
    StepHandle,
)
from dstt.store.format.flat import FlatImage

from ._helpers import same_bits, stored


def _store_writer(run: Path, encoding: DeltaPolicy | None) -> Any:
    return Repository.create(run).writer(
        chunk_bytes=1 << 12, encoding=encoding, inflight_bases=True
    )


def _rank_writer(run: Path, encoding: DeltaPolicy | None) -> Any:
    rw, _ = open_ranks(run, RankInfo(0, 1), resume=False, chunk_bytes=1 << 12, encoding=encoding)
    return rw


WRITERS: dict[str, Callable[[Path, DeltaPolicy | None], Any]] = {
    "store": _store_writer,
    "rank": _rank_writer,
}


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = {f"params/l{i}/w": torch.randn(24, 16, generator=g) for i in range(3)}
    base["params/l0/b"] = torch.randn(16, generator=g).to(torch.bfloat16)
    # a slowly moving state, so XOR deltas pay
    return {p: t + (step * 1e-3 if t.dtype == torch.float32 else 0) for p, t in base.items()}


def _capture(writer: Any, steps: int, budget: int) -> dict[int, dict[str, torch.Tensor]]:
    assert isinstance(writer, FlatStepWriter)  # every name the pipeline uses is there
    pipe = Pipeline(writer, budget_bytes=budget, writers=1, flusher=False)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    try:
        for step in range(1, steps + 1):
            ts = _tensors(step)
            seen[step] = {p: t.clone() for p, t in ts.items()}
            f = pipe.stage(step, ts, {"meta": {"step": step}})
            pipe.wait_copied(f)
            assert isinstance(f.handle, StepHandle)
            pipe.seal(f, {})
            f.done.wait()
        assert not pipe.take_errors()
        return seen
    finally:
        pipe.close()
        writer.close()


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("budget", [1 << 20, 4096], ids=["flat", "segments"])
def test_every_writer_commits_the_same_steps_bit_exactly(
    tmp_path: Path, name: str, budget: int
) -> None:
    run = tmp_path / "run"
    seen = _capture(WRITERS[name](run, None), 4, budget)
    repo = Repository.open(run)
    assert [h.step for h in repo.reader().lineage()] == [1, 2, 3, 4]
    for step, ts in seen.items():
        for path, t in ts.items():
            assert same_bits(stored(repo, step, path), t), (name, step, path)
        assert repo.reader().read_object(repo.reader().find(step), "meta") == {"step": step}
    assert repo.verify().ok


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_writer_encodes_when_its_store_writer_does(tmp_path: Path, name: str) -> None:
    """DeltaPolicy(raw_when_busy=False) always encodes: steps after the first are deltas
    whichever writer the pipeline holds (the RankWriter hid its encoder from the pipeline)."""
    run = tmp_path / "run"
    writer = WRITERS[name](run, DeltaPolicy(raw_when_busy=False, min_ratio=1.0))
    assert writer.encoder is not None
    _capture(writer, 4, 1 << 20)
    r = Repository.open(run).reader()
    encodings = [{c.encoding for a in r.arrays(h).values() for c in a.chunks} for h in r.lineage()]
    assert encodings[0] == {"raw"}
    assert all(e - {"raw"} for e in encodings[1:]), encodings


class _FailsAtBegin:
    """A store writer whose ``begin`` fails for one step (a storage error before any byte)."""

    def __init__(self, writer: Any, bad_step: int) -> None:
        self._w, self.bad_step = writer, bad_step
        self.encoder = writer.encoder

    def begin(self, step: int) -> Any:
        if step == self.bad_step:
            raise OSError(5, "injected failure at begin")
        return self._w.begin(step)

    def flat_layout(self, arrays: Any) -> Any:
        return self._w.flat_layout(arrays)

    def close(self) -> None:
        self._w.close()


@pytest.mark.parametrize("copy", ["async", "sync"])
def test_a_step_that_fails_before_its_write_gives_its_buffer_back(
    tmp_path: Path, copy: str
) -> None:
    """The flat lane's ring has two buffers here: were a failed step to keep its buffer,
    the second failure would leave none and the next copy would wait forever."""
    writer = _FailsAtBegin(_store_writer(tmp_path / "run", None), bad_step=2)
    nbytes = sum(t.numel() * t.element_size() for t in _tensors(0).values())
    pipe = Pipeline(writer, budget_bytes=2 * nbytes + 1024, writers=1, flusher=False, copy=copy)
    try:
        for step in range(1, 8):
            f = pipe.stage(step, _tensors(step), {})
            pipe.wait_copied(f)
            pipe.seal(f, {})
            f.done.wait(timeout=60)
            assert f.done.is_set(), f"step {step} never finished"
            assert pipe.steps is not None
            assert pipe.steps.in_use == 0
        failed = [g.step for g in pipe.take_errors()]
        assert failed == [2]
    finally:
        pipe.close()
        writer.close()
    assert [h.step for h in Repository.open(tmp_path / "run").reader().lineage()] == [
        1,
        3,
        4,
        5,
        6,
        7,
    ]


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_transaction_writes_a_reserved_flat_range_again(tmp_path: Path, name: str) -> None:
    """A flat write the flusher process reserved but died in is written again from the
    engine with ``put_flat(start=)``; every transaction takes it (the rank proxy had
    dropped ``start``, so a rank whose flusher died failed the step instead)."""
    run = tmp_path / "run"
    writer = WRITERS[name](run, None)
    try:
        ts = _tensors(1)
        plan = FlatPlan.build(writer.flat_layout, ts)
        buf = torch.zeros(plan.nbytes, dtype=torch.uint8)
        with torch.no_grad():
            torch._foreach_copy_(plan.views(0, buf), plan.sources(ts))
        txn = writer.begin(1)
        start = txn.reserve_flat(plan.layout, lambda s: FlatImage(plan.layout, s, None).nbytes)
        txn.put_flat(plan.layout, buf.numpy(), start=start)
        txn.commit()
    finally:
        writer.close()
    repo = Repository.open(run)
    for path, t in ts.items():
        assert same_bits(stored(repo, 1, path), t), (name, path)
    assert repo.verify().ok
