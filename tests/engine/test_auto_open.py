"""``dstt.open(run, replay=...)``: ``at``, ``trajectory``, ``diff`` and ``load_into`` reach
the light steps of an ``every="auto"`` run, rebuilt bit for bit by replay."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.engine.state.torch_state import discover
from dstt.errors import ConfigError, ReplayError, StepNotFoundError
from dstt.store._internal import Repository
from dstt.store.storage.memory import MemoryStorage

from ._helpers import same_bits, stored
from .test_auto import DATA, _auto_run, _loss, _model, _schedule, _train


def _same(a: Any, b: Any) -> bool:
    """Deep equality of stored objects (arrays and tensors compared whole)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and same_bits(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def _objects(rich: bool) -> dict[str, Any]:
    """Fresh replay objects, built as ``_train`` builds them."""
    m = _model(dropout=0.2 if rich else 0.0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out: dict[str, Any] = {"model": m, "optimizer": opt, "dataset": DATA, "loss_fn": _loss}
    if rich:
        out["scheduler"] = _schedule(opt)
    return out


def _reference(rich: bool) -> Repository:
    ref = MemoryStorage()
    Repository.create(ref)
    _train(Repository(ref), every=1, rich=rich)
    return Repository(ref)


@pytest.fixture(scope="module")
def rich_pair() -> tuple[Repository, Repository]:
    """(an every=1 reference run with dropout and a scheduler, the same run under auto)."""
    _, _, inner = _auto_run(max_gap=4, rich=True, min_light=3)
    return _reference(True), inner


def test_at_a_light_step_rebuilds_it_bit_for_bit_against_every_1(
    rich_pair: tuple[Repository, Repository],
) -> None:
    ref, inner = rich_pair
    run = dstt.open(inner, replay=_objects(rich=True))
    light = sorted(run.light_steps())
    ref_run = dstt.open(ref)
    for k in light:
        snap = run.at(k)
        assert snap.step == k
        assert snap.rebuilt is not None
        assert snap.rebuilt.base == max(s for s in run.steps if s < k)
        assert snap.rebuilt.checked == list(range(snap.rebuilt.base + 1, k + 1))
        want = ref_run.at(k)
        assert sorted(snap.arrays) == sorted(want.arrays)
        for path in want.arrays:  # params and optimizer state
            assert same_bits(
                torch.from_numpy(snap.to_numpy(path, native=True)),
                stored(ref, k, path),
            ), (k, path)
        # RNG and scheduler: the objects a resume restores, equal to the reference's
        assert _same(snap.object("rng"), want.object("rng")), k
        assert _same(snap.object("scheduler"), want.object("scheduler")), k
        assert snap.metrics["loss"] == want.metrics["loss"]


def test_load_into_a_light_step_restores_what_every_1_stored(
    rich_pair: tuple[Repository, Repository],
) -> None:
    ref, inner = rich_pair
    run = dstt.open(inner, replay=_objects(rich=True))
    k = max(run.light_steps())
    m = _model(dropout=0.2)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    sched = _schedule(opt)
    run.at(k).load_into(m, opt, sched)
    m2 = _model(dropout=0.2)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    sched2 = _schedule(opt2)
    dstt.open(ref).at(k).load_into(m2, opt2, sched2)
    mine, want = discover(m, opt).step_state.tensors(), discover(m2, opt2).step_state.tensors()
    assert all(same_bits(mine[p], want[p]) for p in want)
    assert sched.state_dict()["last_epoch"] == sched2.state_dict()["last_epoch"] == k


def test_a_trajectory_across_light_steps_equals_the_reference(
    rich_pair: tuple[Repository, Repository],
) -> None:
    ref, inner = rich_pair
    calls: list[tuple[int, int]] = []
    run = dstt.open(inner, replay=_objects(rich=True))
    light = sorted(run.light_steps())
    got = run.trajectory("0.weight", progress=lambda n, total: calls.append((n, total)))
    want = dstt.open(ref).trajectory("0.weight")
    assert got["step"].values.tolist() == list(range(1, 25))
    assert (got.values.view("uint32") == want.values.view("uint32")).all()
    assert got.attrs["rebuilt_steps"] == light
    assert sorted(got["step"].values[got["slot"].values == -1].tolist()) == light
    assert calls[-1] == (len(light), len(light))
    # an optimizer state over a slice, and the cache answers the second time
    sl = slice(light[0] - 1, light[-1])
    a = run.trajectory("0.weight", sl, state="exp_avg")
    b = dstt.open(ref).trajectory("0.weight", sl, state="exp_avg")
    assert (a.values == b.values).all()


def test_a_range_rebuilds_in_one_pass_per_gap_and_is_cached() -> None:
    _, _, inner = _auto_run(max_gap=4, min_light=3)
    made, calls = 0, 0

    def counted(m: torch.nn.Module, b: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return _loss(m, b)

    def make() -> dict[str, Any]:
        nonlocal made
        made += 1
        return {**_objects(rich=False), "loss_fn": counted}

    run = dstt.open(inner, replay=make)
    light = sorted(run.light_steps())
    base = {k: max(s for s in run.steps if s < k) for k in light}
    first = run.rebuilt(light)
    assert made == 1
    assert set(first) == set(light)
    assert all(first[k].rebuilt.base == base[k] for k in light)
    # one pass per gap: each gap's chain replayed once, up to its last light step
    last = {b: max(k for k in light if base[k] == b) for b in set(base.values())}
    assert calls == sum(k - b for b, k in last.items())
    assert run.at(light[-1]) is first[light[-1]]  # from the cache, no replay
    assert calls == sum(k - b for b, k in last.items())


def test_diff_between_a_stored_and_a_light_step() -> None:
    ref = _reference(False)
    _, _, inner = _auto_run(max_gap=4)
    run = dstt.open(inner, replay=_objects(rich=False))
    k = min(run.light_steps())
    j = max(s for s in run.steps if s < k)
    got = run.diff(j, k, optim=True)
    want = dstt.open(ref).diff(j, k, optim=True)
    assert got["delta_l2"].values.tolist() == want["delta_l2"].values.tolist()
    assert got.attrs["step_b"] == k


def test_a_tampered_replay_breaks_the_chain_where_it_differs() -> None:
    _, _, inner = _auto_run(max_gap=4)
    bad = _objects(rich=False)
    bad["loss_fn"] = lambda m, b: _loss(m, b) * 2  # not the loss training logged
    run = dstt.open(inner, replay=bad)
    k = min(run.light_steps())
    j = max(s for s in run.steps if s < k)
    with pytest.raises(ReplayError, match=f"chain broke at step {j + 1}"):
        run.at(k)


def test_without_replay_objects_a_light_step_names_its_neighbours_and_the_way() -> None:
    _, run, _ = _auto_run()
    k = min(run.light_steps())
    before = max(s for s in run.steps if s < k)
    with pytest.raises(StepNotFoundError, match=rf"{before}.*dstt\.open\(path, replay="):
        run.at(k)
    with pytest.raises(ConfigError, match="nothing to rebuild them with"):
        run.rebuilt([k])


@pytest.mark.parametrize(
    ("replay", "match"),
    [({"model": 1}, "needs 'model' and 'optimizer'"), ({"modle": 1}, "unknown keys"), (3, "dict")],
)
def test_bad_replay_objects_are_refused(replay: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dstt.open(Repository.create(MemoryStorage()), replay=replay)


FACTORY = """
import torch

def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)

def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    data = torch.utils.data.TensorDataset(
        torch.randn(96, 8, generator=torch.Generator().manual_seed(1)),
        torch.randn(96, 4, generator=torch.Generator().manual_seed(2)),
    )
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    return {"model": m, "optimizer": opt, "dataset": data, "loss_fn": _loss}
"""


def test_a_factory_named_at_session_time_rebuilds_with_replay_true(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(FACTORY)
    _, _, inner = _auto_run(max_gap=4, replay=f"{script}:make")
    run = dstt.open(inner, replay=True)
    by_dict = dstt.open(inner, replay=_objects(rich=False))
    for k in sorted(run.light_steps())[:3]:
        got, want = run.at(k), by_dict.at(k)
        assert got.rebuilt.checked == list(range(got.rebuilt.base + 1, k + 1))
        for path in want.arrays:
            assert (
                got.to_numpy(path, native=True).tobytes()
                == want.to_numpy(path, native=True).tobytes()
            )
    # a run whose sessions named none says how to pass the objects instead
    _, _, plain = _auto_run()
    with pytest.raises(ConfigError, match="names no replay factory"):
        dstt.open(plain, replay=True)


@pytest.mark.parametrize(
    ("spec", "match"), [("train.py", "FILE.py:FUNCTION"), ("nope.py:make", "no file")]
)
def test_a_bad_factory_is_refused_before_training(spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        dstt.SessionOptions(run="runs/x", every="auto", replay=spec)


def test_persisted_rebuilt_steps_open_without_replay_and_are_not_history() -> None:
    ref = _reference(True)
    _, _, inner = _auto_run(max_gap=4, rich=True, min_light=3)
    run = dstt.open(inner, replay=_objects(rich=True))
    light = sorted(run.light_steps())
    steps_before = list(run.steps)
    written = run.rebuilt(light[:2], persist=True)
    later = dstt.open(inner)  # a later process: no replay objects
    for k in light[:2]:
        snap, want = later.at(k), dstt.open(ref).at(k)
        assert snap.rebuilt is not None
        assert snap.rebuilt.base == written[k].rebuilt.base
        assert snap.rebuilt.checked == written[k].rebuilt.checked
        for path in want.arrays:
            assert same_bits(
                torch.from_numpy(snap.to_numpy(path, native=True)), stored(ref, k, path)
            )
        assert _same(snap.object("rng"), want.object("rng"))
    # a light step not written still needs the objects
    with pytest.raises(StepNotFoundError, match="replay="):
        later.at(light[2])
    # never history: the steps, verify and gc see the run as trained
    assert later.steps == steps_before
    assert later.verify().ok
    later.gc()
    assert dstt.open(inner).steps == steps_before
    assert dstt.open(inner).at(light[0]).rebuilt is not None
