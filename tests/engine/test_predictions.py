"""Predictive coding through the session: which arrays get predictions, the order they are
written in, the CPU governor, and bit-exact time travel and resume of predicted steps."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dstt import DeltaPolicy
from dstt.engine.capture.governor import EncodeGovernor
from dstt.engine.state.predictions import optimizer_predictions
from dstt.schema import tensor_path
from dstt.store import Repository
from dstt.testing.models import SyntheticBatches, TinyGPT
from dstt.training import session

from ._helpers import same_bits, stored, train_step


def _stepped(opt_cls: type, **kw: object) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4)
    opt = opt_cls(lin.parameters(), **kw)
    for _ in range(3):
        lin(torch.randn(5, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return lin, opt


def _preds(lin: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:  # type: ignore[type-arg]
    names = {id(p): n for n, p in lin.named_parameters()}
    params = [(p, names[id(p)]) for g in opt.param_groups for p in g["params"]]
    return dict(optimizer_predictions(opt, params, tensor_path))


def _stop_and_resume(run: Path, make: Any, data: SyntheticBatches, *, stop: int) -> Any:
    """Train with predictions until ``stop``, resume in a fresh model and optimizer, and
    check the resumed losses against an uninterrupted run; returns the arrays table of the
    step resumed from."""
    m, opt = make()
    ref = [train_step(m, opt, x, y) for x, y in data]
    m, opt = make()
    pol = DeltaPolicy(keyframe_every=20, raw_when_busy=False)
    with session(m, opt, run=run, encoding=pol, max_backlog=1) as s:
        for x, y in s.data(data):
            train_step(m, opt, x, y)
            s.wait()
            time.sleep(0.03)  # let the step commit: predictions need committed bases
            if s.step == stop:
                break
    r = Repository.open(run).reader()
    head = r.head()
    assert head is not None
    assert head.step == stop
    m2, opt2 = make()
    with session(m2, opt2, run=run, resume=True, encoding=pol) as s:
        got = [train_step(m2, opt2, x, y) for x, y in s.data(data)]
    assert got == ref[stop:]
    return r.arrays(head)


def test_adamw_gets_predictions_with_the_steps_coefficients() -> None:
    lin, opt = _stepped(torch.optim.AdamW, lr=2e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.5)
    preds = _preds(lin, opt)
    assert set(preds) == {
        "params/weight",
        "params/bias",
        "optim/exp_avg_sq/weight",
        "optim/exp_avg_sq/bias",
    }
    p = preds["params/weight"]
    assert p.fn == "adam_p"
    assert p.inputs == (("cur", "optim/exp_avg/weight"), ("cur", "optim/exp_avg_sq/weight"))
    decay, bias2_sqrt, eps, step_size = p.coeffs
    assert decay == pytest.approx(1 - 2e-3 * 0.5, rel=1e-6)  # decoupled weight decay
    assert bias2_sqrt == pytest.approx(math.sqrt(1 - 0.9**3), rel=1e-6)  # three steps taken
    assert step_size == pytest.approx(2e-3 / (1 - 0.8**3), rel=1e-6)
    assert eps == pytest.approx(1e-6, rel=1e-6)
    v = preds["optim/exp_avg_sq/weight"]
    assert v.fn == "adam_v"
    assert v.coeffs[0] == pytest.approx(0.8)
    assert v.coeffs[2] == pytest.approx(0.9)


def test_adam_with_l2_decay_predicts_without_decoupled_decay() -> None:
    lin, opt = _stepped(torch.optim.Adam, lr=1e-3, weight_decay=0.1)
    assert _preds(lin, opt)["params/weight"].coeffs[0] == 1.0


@pytest.mark.parametrize(
    "make",
    [
        lambda: _stepped(torch.optim.SGD, lr=0.1),  # no momentum buffer
        lambda: _stepped(torch.optim.SGD, lr=0.1, momentum=0.9, nesterov=True),
        lambda: _stepped(torch.optim.AdamW, lr=1e-3, amsgrad=True),
        lambda: _stepped(torch.optim.RMSprop, lr=1e-3),
    ],
)
def test_other_optimizers_get_none(make) -> None:  # type: ignore[no-untyped-def]
    assert _preds(*make()) == {}


def test_sgd_with_momentum_predicts_the_parameter_from_its_buffer() -> None:
    lin, opt = _stepped(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-4)
    preds = _preds(lin, opt)
    assert set(preds) == {"params/weight", "params/bias"}
    p = preds["params/weight"]
    assert p.fn == "sgd_p"
    assert p.inputs == (("cur", "optim/momentum_buffer/weight"),)
    assert p.coeffs == (pytest.approx(-0.05),)


def test_session_with_sgd_momentum_writes_predictions_and_resumes_exactly(tmp_path: Path) -> None:
    data = SyntheticBatches(12, batch_size=4, seq=16, vocab=64, seed=9)

    def make() -> tuple[TinyGPT, torch.optim.Optimizer]:
        torch.manual_seed(0)
        m = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.0)
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    head = _stop_and_resume(tmp_path / "run", make, data, stop=7)
    recs = head["params/layers/0/qkv/weight"].chunks
    assert {c.encoding for c in recs} == {"pred1"}
    assert recs[0].predictor == "sgd_p"


def test_non_fp32_state_gets_none() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-3)
    lin(torch.randn(5, 8, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    assert _preds(lin, opt) == {}


def test_governor_encodes_when_it_flushes_faster_and_re_measures() -> None:
    g = EncodeGovernor(writers=1, cores=2, retry_every=4)
    assert g.decide()  # nothing measured yet: measure encoding first
    g.observe(True, 0.3, 0.4, 100)  # encoded: 0.3 s CPU, 100 bytes written
    assert not g.decide()  # then one raw step to compare with...
    assert g.decide()
    assert g.decide()  # ...and encode until it committed (commits lag)
    g.observe(False, 0.2, 1.2, 300)  # raw: less CPU, 3x the bytes; the disk: 250 B/s
    assert g.estimates() == {"encoded": pytest.approx(0.4), "raw": pytest.approx(1.2)}
    decisions = [g.decide() for _ in range(28)]
    # encode; re-measure raw after 4 steps, then 8, then 16 while encoding stays the choice
    assert decisions == [True] * 3 + [False] + [True] * 7 + [False] + [True] * 15 + [False]
    for _ in range(16):  # the disk got fast: now the CPU binds, and raw needs less of it
        g.observe(False, 0.2, 0.01, 300)
    assert g.estimates() == {"encoded": pytest.approx(0.3), "raw": pytest.approx(0.2)}
    decisions = [g.decide() for _ in range(12)]
    assert decisions == [False] * 3 + [True] + [False] * 7 + [True]  # the base rate again


def test_governor_backs_off_to_eight_times_retry_every() -> None:
    g = EncodeGovernor(writers=1, cores=2, retry_every=2)
    g.decide()
    g.observe(True, 0.1, 0.0, 100)
    g.decide()
    g.observe(False, 0.5, 0.0, 300)  # raw costs more CPU: encode
    decisions = [g.decide() for _ in range(80)]
    gaps = [i for i, d in enumerate(decisions) if not d]
    assert np.diff(gaps).tolist() == [4, 8, 16, 16, 16, 16]  # capped at 8 * retry_every


def test_governor_writes_raw_until_encoding_is_measured() -> None:
    """The first encoded step makes the bases, the second is measured; until one has
    committed with deltas the rest go raw, with a retry every ``retry_every`` steps."""
    g = EncodeGovernor(writers=1, cores=2, retry_every=4)
    assert [g.decide() for _ in range(11)] == [True, True] + [False] * 3 + [True] + [False] * 3 + [
        True
    ] + [False]


def test_governor_counts_the_cores_the_writers_get() -> None:
    g = EncodeGovernor(writers=4, cores=8)
    g.observe(True, 0.8, 0.0, 100)  # 0.8 s of CPU over 4 writer threads: 0.2 s
    g.observe(False, 0.6, 0.0, 300)  # 0.15 s
    assert g.estimates() == {"encoded": pytest.approx(0.2), "raw": pytest.approx(0.15)}
    assert not g.decide()


def test_governor_disabled_always_encodes() -> None:
    g = EncodeGovernor(writers=1, cores=2, enabled=False)
    g.observe(True, 100.0, 0.0, 1)
    g.observe(False, 0.0, 0.0, 1)
    assert all(g.decide() for _ in range(5))


def _model() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)
    return m, opt


def test_session_writes_predicted_steps_that_read_back_bit_exactly(tmp_path: Path) -> None:
    m, opt = _model()
    data = SyntheticBatches(14, batch_size=4, seq=16, vocab=64, seed=3)
    path = "layers/0/qkv/weight"
    after: dict[int, dict[str, torch.Tensor]] = {}
    with session(
        m,
        opt,
        run=tmp_path / "run",
        max_backlog=1,
        encoding=DeltaPolicy(keyframe_every=6, raw_when_busy=False),
    ) as s:
        for x, y in s.data(data):
            train_step(m, opt, x, y)
            p = m.layers[0].qkv.weight
            after[s.step] = {
                f"params/{path}": p.detach().clone(),
                f"optim/exp_avg/{path}": opt.state[p]["exp_avg"].clone(),
                f"optim/exp_avg_sq/{path}": opt.state[p]["exp_avg_sq"].clone(),
            }
            s.wait()
            time.sleep(0.03)  # let the step commit: predictions need committed bases
    repo = Repository.open(tmp_path / "run")
    r = repo.reader()
    kinds = {c.encoding for h in r.lineage() for c in r.arrays(h)[f"params/{path}"].chunks}
    assert "pred1" in kinds
    for step, tensors in after.items():
        for name, t in tensors.items():
            assert same_bits(stored(repo, step, name), t), (step, name)
    assert repo.verify().ok
    ms = s.metrics
    # steps between keyframes (exp_avg and the 0-d step counters stay raw: new information)
    between = [x for x in ms[1:] if x.deltas > 0]
    assert len(between) >= 8
    assert all(x.written_bytes < 0.6 * x.bytes for x in between)


def test_resume_from_a_predicted_step_continues_bit_exactly(tmp_path: Path) -> None:
    data = SyntheticBatches(16, batch_size=4, seq=16, vocab=64, seed=5)
    head = _stop_and_resume(tmp_path / "run", _model, data, stop=9)
    assert any(c.encoding == "pred1" for a in head.values() for c in a.chunks)


def test_a_failed_step_takes_only_the_steps_based_on_it(tmp_path: Path) -> None:
    """Step 4's commit fails; a step encoded against it while it was in flight is dropped
    too; the run recovers with keyframes and every committed step reads back exactly."""
    import errno
    import warnings

    from dstt.store.storage.memory import FaultyStorage, MemoryStorage

    inner = MemoryStorage()
    Repository.create(inner)
    faulty = FaultyStorage(inner, errno=errno.EIO, fail_keys=r"commits/000000000003\.json")
    m, opt = _model()
    after: dict[int, torch.Tensor] = {}
    data = SyntheticBatches(10, batch_size=4, seq=16, vocab=64, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with session(
            m,
            opt,
            run=Repository(faulty),
            error_policy="skip",
            encoding=DeltaPolicy(raw_when_busy=False),
        ) as s:
            for x, y in s.data(data):
                train_step(m, opt, x, y)
                after[s.step] = m.layers[0].qkv.weight.detach().clone()
    plain = Repository(inner)
    steps = [h.step for h in plain.reader().lineage()]
    assert 4 not in steps
    assert steps[-1] == 10
    assert steps[:3] == [1, 2, 3]
    dropped = [x for x in s.metrics if not x.committed]
    assert {x.step for x in dropped} <= {4, 5, 6}
    for x in dropped:
        assert x.step == 4 or "did not commit" in (x.error or ""), x.error
    for step in steps:
        assert same_bits(stored(plain, step, "params/layers/0/qkv/weight"), after[step])
    assert plain.verify().problems == []


def test_keyframe_on_request_writes_the_next_step_whole(tmp_path: Path) -> None:
    import zarr

    m, opt = _model()
    with session(
        m,
        opt,
        run=tmp_path / "run",
        max_backlog=1,
        encoding=DeltaPolicy(keyframe_every=30, raw_when_busy=False),
    ) as s:
        for x, y in s.data(SyntheticBatches(8, batch_size=4, seq=16, vocab=64, seed=2)):
            train_step(m, opt, x, y)
            s.wait()
            time.sleep(0.03)
            if s.step == 5:
                s.keyframe()
    r = Repository.open(tmp_path / "run").reader()
    kinds = {
        h.step: {c.encoding for a in r.arrays(h).values() for c in a.chunks} for h in r.lineage()
    }
    assert kinds[5] != {"raw"}
    assert kinds[6] == {"raw"}
    assert "pred1" in kinds[7]
    h7 = r.find(7)
    assert {c.base for c in r.arrays(h7)["params/layers/0/qkv/weight"].chunks} == {r.find(6).slot}

    def plain(step: int) -> np.ndarray:  # a plain Zarr reader of one step's zip
        zs = zarr.storage.ZipStore(
            tmp_path / "run" / "steps" / f"{r.find(step).slot:012d}.zip", mode="r"
        )
        try:
            arr = zarr.open_group(zs, mode="r", zarr_format=3)["params/layers/0/qkv/weight"]
            assert isinstance(arr, zarr.Array)
            return np.asarray(arr[...])
        finally:
            zs.close()

    got = stored(Repository.open(tmp_path / "run"), 6, "params/layers/0/qkv/weight")
    assert np.array_equal(plain(6), got.numpy())  # plain Zarr reads step 6
    assert np.isnan(plain(7)).all()  # and sees the predicted step 7 as missing
    assert [x.raw_fallback for x in s.metrics] == [False] * 8


def test_governor_takes_the_disk_speed_from_raw_steps() -> None:
    """What an encoded step waits for includes the interpreter lock and CPU: it must not make
    raw steps look slow (that fed back: more encoding, slower steps, ever slower "disk")."""
    g = EncodeGovernor(writers=1, cores=2)
    g.observe(True, 0.1, 5.0, 100)  # encoded: waited 5 s, not for the disk
    g.observe(False, 0.1, 0.3, 300)  # raw: 300 bytes in 0.3 s
    assert g.estimates() == {"encoded": pytest.approx(0.1), "raw": pytest.approx(0.3)}


def test_governor_gives_the_writers_only_the_cores_training_leaves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from dstt.engine.capture import governor as gov

    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(
        gov,
        "time",
        SimpleNamespace(perf_counter=lambda: clock["wall"], process_time=lambda: clock["cpu"]),
    )
    g = EncodeGovernor(writers=2, cores=4)
    assert g.capacity == 2
    clock.update(wall=1.0, cpu=3.5)  # 3.5 cores busy for a second, 0.5 of it the writers'
    g.observe(False, 0.5, 0.0, 100)
    assert g.capacity == pytest.approx(1.0)  # 4 cores, 3 busy besides the writers
    clock.update(wall=1.1, cpu=3.9)  # too short a sample: kept
    g.observe(False, 0.0, 0.0, 100)
    assert g.capacity == pytest.approx(1.0)
    clock.update(wall=2.1, cpu=7.9)  # every core busy training (spinning workers count)
    g.observe(False, 0.0, 0.0, 100)
    assert g.capacity == 0.25


def test_governor_measures_the_cores_only_over_raw_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoding writer's Python takes CPU from training, which then seems to need fewer
    cores: a sample with an encoded step in it changes nothing. Until measured, training
    is assumed to run on its torch threads."""
    from types import SimpleNamespace

    from dstt.engine.capture import governor as gov

    assert EncodeGovernor(writers=2, cores=4, train_threads=4).capacity == 0.25
    assert EncodeGovernor(writers=2, cores=4, train_threads=3).capacity == 1.0
    clock = {"wall": 0.0, "cpu": 0.0}
    monkeypatch.setattr(
        gov,
        "time",
        SimpleNamespace(perf_counter=lambda: clock["wall"], process_time=lambda: clock["cpu"]),
    )
    g = EncodeGovernor(writers=2, cores=4, train_threads=4)
    clock.update(wall=1.0, cpu=2.0)  # 1 core of training left next to 1 of encoding
    g.observe(True, 1.0, 0.0, 100)
    assert g.capacity == 0.25  # not measured: an encoded step was in the sample
    clock.update(wall=2.0, cpu=3.0)  # raw steps only: training keeps 1 core busy
    g.observe(False, 0.0, 0.0, 300)
    assert g.capacity == pytest.approx(2.0)
