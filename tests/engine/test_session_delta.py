"""The session with ``encoding=DeltaPolicy()``: fewer bytes, same bits, exact resume."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dstt import DeltaPolicy, StepMetrics
from dstt.store import Repository
from dstt.testing.models import SyntheticBatches, TinyGPT
from dstt.training import session

from ._helpers import same_bits, stored, train_step


def _model() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.0)
    m.tok.weight.requires_grad_(False)  # frozen, tied to the head: written once, then referenced
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    return m, opt


def _written(run: Path, encoding: DeltaPolicy | None) -> list[StepMetrics]:
    m, opt = _model()
    with session(m, opt, run=run, encoding=encoding) as s:
        for x, y in s.data(SyntheticBatches(8, batch_size=4, seq=16, vocab=64, seed=3)):
            train_step(m, opt, x, y)
            s.wait()
            time.sleep(0.05)  # a slower training step: the flush keeps up, so steps get encoded
    return list(s.metrics)


def _chunk_bytes(run: Path, step: int) -> dict[str, list[tuple[str, int]]]:
    """(encoding, stored bytes) of every chunk of every array of ``step``, from its arrays
    table."""
    r = Repository.open(run).reader()
    return {
        path: [(c.encoding, c.nbytes) for c in a.chunks]
        for path, a in r.arrays(r.find(step)).items()
    }


def test_delta_encoded_steps_are_bit_exact(tmp_path: Path) -> None:
    m, opt = _model()
    data = SyntheticBatches(12, batch_size=4, seq=16, vocab=64, seed=3)
    after: dict[int, dict[str, torch.Tensor]] = {}
    with session(
        m, opt, run=tmp_path / "run", encoding=DeltaPolicy(keyframe_every=4), max_backlog=1
    ) as s:
        for x, y in s.data(data):
            train_step(m, opt, x, y)
            after[s.step] = {
                "params/layers/0/qkv/weight": m.layers[0].qkv.weight.detach().clone(),
                "params/tok/weight": m.tok.weight.detach().clone(),
            }
            s.wait()  # seal the step; the sleep lets it commit: deltas need a committed base
            time.sleep(0.05)
    repo = Repository.open(tmp_path / "run")
    for step, tensors in after.items():
        for path, t in tensors.items():
            assert same_bits(stored(repo, step, path), t), (step, path)
    assert repo.verify().ok
    ms = s.metrics
    assert sum(x.dedups for x in ms) > 0  # the frozen embedding, whenever a base was there


def test_delta_encoding_writes_fewer_bytes_than_raw(tmp_path: Path) -> None:
    raw = _written(tmp_path / "raw", None)
    # always encode: the governor may otherwise write steps raw where that flushes faster
    enc = _written(tmp_path / "enc", DeltaPolicy(raw_when_busy=False))
    # no base yet: keyframes only, the same tensor bytes (the runs' objects may differ in
    # size: a raw step is written whole, an encoded one chunk by chunk)
    first = _chunk_bytes(tmp_path / "raw", raw[0].step)
    assert first == _chunk_bytes(tmp_path / "enc", enc[0].step)
    assert {e for chunks in first.values() for e, _ in chunks} == {"raw"}
    assert enc[0].keyframes > 0
    assert enc[0].deltas == enc[0].dedups == 0
    tensor_bytes = sum(n for chunks in first.values() for _, n in chunks)
    assert min(raw[0].written_bytes, enc[0].written_bytes) >= tensor_bytes
    based = [i for i in range(1, len(enc)) if enc[i].dedups or enc[i].deltas]
    assert len(based) >= len(enc) // 2
    for i in based:  # the frozen embedding alone is deduplicated in every encoded step
        assert enc[i].dedups > 0
        assert enc[i].written_bytes < raw[i].written_bytes


def test_resume_after_delta_steps_continues_bit_exactly(tmp_path: Path) -> None:
    data = SyntheticBatches(16, batch_size=4, seq=16, vocab=64, seed=5)
    m, opt = _model()
    ref = [train_step(m, opt, x, y) for x, y in data]

    m, opt = _model()
    with session(m, opt, run=tmp_path / "run", encoding=DeltaPolicy()) as s:
        for x, y in s.data(data):
            train_step(m, opt, x, y)
            if s.step == 9:
                break
    m2, opt2 = _model()
    got = []
    with session(m2, opt2, run=tmp_path / "run", resume=True, encoding=DeltaPolicy()) as s:
        assert s.step == 9
        for x, y in s.data(data):
            got.append(train_step(m2, opt2, x, y))
    assert got == ref[9:]


def test_metrics_report_the_writer_cpu(tmp_path: Path) -> None:
    m, opt = _model()
    with session(m, opt, run=tmp_path / "run") as s:
        for x, y in s.data(SyntheticBatches(3, batch_size=4, seq=16, vocab=64, seed=1)):
            train_step(m, opt, x, y)
    assert all(x.writer_cpu_s > 0 for x in s.metrics)


def test_an_encoding_session_captures_every_step_with_one_batched_copy(tmp_path: Path) -> None:
    """Encoded steps too are staged into the flat lane's step buffers (one batched copy, no
    host cache of leased chunks, no copy task per tensor) and encoded from there chunk by
    chunk; a step the governor writes raw goes out whole, through the flusher process."""
    m, opt = _model()
    run = tmp_path / "run"
    with session(m, opt, run=run, encoding=DeltaPolicy(raw_when_busy=False)) as s:
        for x, y in s.data(SyntheticBatches(5, batch_size=4, seq=16, vocab=64, seed=3)):
            train_step(m, opt, x, y)
            s.wait()
            time.sleep(0.05)
        p = s._pipeline
        assert p is not None
        assert p.steps is not None
        w = m.layers[0].qkv.weight
        final = {
            "params/layers/0/qkv/weight": w.detach().clone(),
            "optim/exp_avg/layers/0/qkv/weight": opt.state[w]["exp_avg"].clone(),
        }
    ms = s.metrics
    assert all(x.raw_fallback is False for x in ms)
    assert sum(x.deltas + x.dedups for x in ms[1:]) > 0
    r = Repository.open(run).reader()
    kinds = [{c.encoding for a in r.arrays(h).values() for c in a.chunks} for h in r.lineage()]
    assert kinds[0] == {"raw"}, kinds
    assert all(k - {"raw"} for k in kinds[1:]), kinds
    for path, want in final.items():  # the last step, encoded from the step buffer
        assert same_bits(stored(Repository.open(run), 5, path), want), path


def test_steps_the_governor_writes_raw_go_out_whole_and_keep_the_bases(tmp_path: Path) -> None:
    """With a governor that always says raw after the first step, every later step is one
    whole flat write (no deltas), and the session still resumes exactly; the next encoded
    step deltas against the last bases that were committed."""
    from dstt.engine.capture.governor import EncodeGovernor
    from dstt.engine.state.providers import CompositeProvider

    decisions = iter([True, True, False, False, False, True])
    orig = EncodeGovernor.decide
    EncodeGovernor.decide = lambda self: next(decisions)  # type: ignore[method-assign]
    built = []
    orig_predictions = CompositeProvider.predictions

    def predictions(self: CompositeProvider) -> object:
        built.append(1)
        return orig_predictions(self)

    CompositeProvider.predictions = predictions  # type: ignore[assignment,method-assign]
    try:
        m, opt = _model()
        run = tmp_path / "run"
        with session(m, opt, run=run, encoding=DeltaPolicy(min_ratio=1.0)) as s:
            for x, y in s.data(SyntheticBatches(6, batch_size=4, seq=16, vocab=64, seed=3)):
                train_step(m, opt, x, y)
                s.wait()
                time.sleep(0.05)
            assert s._pipeline is not None
            assert s._pipeline.sink.flusher is not None
            final = m.layers[0].qkv.weight.detach().clone()
    finally:
        EncodeGovernor.decide = orig  # type: ignore[method-assign]
        CompositeProvider.predictions = orig_predictions  # type: ignore[method-assign]
    ms = s.metrics
    assert [x.raw_fallback for x in ms] == [False, False, True, True, True, False]
    assert len(built) == 3  # predictions are built for the encoded steps only
    r = Repository.open(run).reader()
    heads = {h.step: h for h in r.lineage()}
    for step in (3, 4, 5):
        assert {c.encoding for a in r.arrays(heads[step]).values() for c in a.chunks} == {"raw"}
    bases = {c.base for a in r.arrays(heads[6]).values() for c in a.chunks if c.base is not None}
    assert bases
    assert bases <= {heads[1].slot, heads[2].slot}  # committed encoded steps
    assert same_bits(stored(Repository.open(run), 6, "params/layers/0/qkv/weight"), final)
    assert Repository.open(run).verify().ok
