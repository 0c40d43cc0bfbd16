"""``every="auto"`` with two real ranks (spawned, gloo): every rank stores the same steps
(each optimizer step's decision is agreed across ranks); a DDP run's light steps rebuild in
one process bit for bit against an every=1 reference run (parameters, optimizer state, each
rank's RNG, the scheduler), from every rank's recorded samples; an FSDP2 run's light steps
refuse a rebuild with a typed "not yet" error rather than a wrong state. Over 3 ranks the
rebuild replays in a spawned gloo world of 3, bit for bit too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.errors import ConfigError, ReplayError

from .auto_worker import DATA, STEPS, loss_fn, plain
from .conftest import launch, logs_of, wait

WORKER = Path(__file__).with_name("auto_worker.py")


def _train(
    root: Path, kind: str, every: str, name: str, world: int = 2
) -> tuple[Path, list[list[int]]]:
    """A run of ``kind`` over ``world`` ranks; each rank's stored steps."""
    run_dir = root / name
    tag = f"{kind}{every}"
    wait(launch(WORKER, [str(run_dir), str(root), kind, every], world, root, tag))
    got = []
    for rank in range(world):
        f = root / f"{tag}.r{rank}.json"
        assert f.exists(), logs_of(root, tag)
        got.append(json.loads(f.read_text())["stored"])
        f.unlink()
    return run_dir, got


def _auto(root: Path, kind: str, world: int = 2) -> tuple[Path, list[list[int]]]:
    for attempt in range(3):  # a fast machine may keep up now and then
        run_dir, got = _train(root, kind, "auto", f"{kind}-auto{attempt}", world)
        if dstt.open(run_dir).light_steps():
            return run_dir, got
    raise AssertionError("rank 1's slowed storage never made the engines busy")


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[list[int]]]:
    """(an every=1 DDP reference run, the same run under every="auto", its ranks' stored)."""
    root = tmp_path_factory.mktemp("ddp")
    ref, _ = _train(root, "ddp", "1", "ddp-ref")
    auto, got = _auto(root, "ddp")
    return ref, auto, got


def _objects() -> dict[str, Any]:
    net, opt, sched = plain()
    return {"model": net, "optimizer": opt, "scheduler": sched, "dataset": DATA, "loss_fn": loss_fn}


def _bits(a: np.ndarray) -> tuple[str, tuple[int, ...], bytes]:
    return str(a.dtype), a.shape, np.ascontiguousarray(a).tobytes()


def _same(a: Any, b: Any) -> bool:
    """Deep equality of stored objects (arrays and tensors compared whole, bit for bit)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and _bits(a.numpy()) == _bits(b.numpy())
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and _bits(a) == _bits(b)
    return bool(a == b)


def test_ddp_ranks_agree_which_steps_are_stored(ddp: tuple[Path, Path, list[list[int]]]) -> None:
    _, auto, got = ddp
    assert got[0] == got[1]  # the same steps on both ranks
    run = dstt.open(auto)
    assert run.steps == got[0]
    assert sorted([*run.steps, *run.light_steps()]) == list(range(1, STEPS + 1))
    assert all(bits is not None for bits in run.light_steps().values())


def test_a_ddp_light_step_rebuilds_bit_for_bit_against_every_1(
    ddp: tuple[Path, Path, list[list[int]]],
) -> None:
    ref_dir, auto, _ = ddp
    run, ref = dstt.open(auto, replay=_objects()), dstt.open(ref_dir)
    light = sorted(run.light_steps())
    for k in light:
        snap, want = run.at(k), ref.at(k)
        assert snap.rebuilt is not None
        assert snap.rebuilt.checked == list(range(snap.rebuilt.base + 1, k + 1))
        assert sorted(snap.arrays) == sorted(want.arrays)
        for path in want.arrays:  # parameters and optimizer state
            got = snap.to_numpy(path, native=True)
            assert _bits(got) == _bits(want.to_numpy(path, native=True)), (k, path)
        for name in ("rng/r0", "rng/r1", "scheduler"):  # each rank's RNG, the scheduler
            assert _same(snap.object(name), want.object(name)), (k, name)
    traj, ref_traj = run.trajectory("3.weight"), ref.trajectory("3.weight")
    assert traj["step"].values.tolist() == list(range(1, STEPS + 1))
    assert (traj.values.view("uint32") == ref_traj.values.view("uint32")).all()


def test_a_ddp_light_step_replayed_on_other_samples_breaks_the_chain(
    ddp: tuple[Path, Path, list[list[int]]],
) -> None:
    """The ranks' samples, each one further on than recorded: the chain breaks at once."""
    _, auto, _ = ddp
    run = dstt.open(auto)
    k = min(run.light_steps())
    base = max(s for s in run.steps if s < k)
    net, opt, sched = plain()
    swapped = {i: DATA[(i + 1) % len(DATA)] for i in range(len(DATA))}

    def shifted(ix: list[int]) -> Any:  # every sample one further on, for every rank
        from torch.utils.data import default_collate

        return default_collate([swapped[i] for i in ix])

    with pytest.raises(ReplayError, match=rf"the chain broke at step {base + 1}:"):
        run.rebuild(k, net, opt, scheduler=sched, batches=shifted, loss_fn=loss_fn)


def test_an_fsdp2_light_step_refuses_a_rebuild_with_a_typed_error(tmp_path: Path) -> None:
    auto, got = _auto(tmp_path, "fsdp")
    assert got[0] == got[1]
    run = dstt.open(auto, replay=_objects())
    k = min(run.light_steps())
    with pytest.raises(ReplayError, match=r"shard of the state.*not supported yet"):
        run.at(k)
    assert run.at(min(run.steps)).step == min(run.steps)  # the stored steps open as usual


@pytest.fixture(scope="module")
def ddp3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(an every=1 DDP reference run over 3 ranks, the same run under every="auto")."""
    root = tmp_path_factory.mktemp("ddp3")
    ref, _ = _train(root, "ddp", "1", "ddp3-ref", world=3)
    auto, got = _auto(root, "ddp", world=3)
    assert got[0] == got[1] == got[2]
    return ref, auto


def test_a_ddp_light_step_over_three_ranks_rebuilds_bit_for_bit(ddp3: tuple[Path, Path]) -> None:
    """Over 3 ranks the rebuild replays in a spawned gloo world of 3: the real allreduce."""
    ref_dir, auto = ddp3
    run, ref = dstt.open(auto, replay=_objects()), dstt.open(ref_dir)
    light = sorted(run.light_steps())
    for k in light:
        snap, want = run.at(k), ref.at(k)
        assert snap.rebuilt is not None
        assert snap.rebuilt.checked == list(range(snap.rebuilt.base + 1, k + 1))
        assert sorted(snap.arrays) == sorted(want.arrays)
        for path in want.arrays:  # parameters and optimizer state
            got = snap.to_numpy(path, native=True)
            assert _bits(got) == _bits(want.to_numpy(path, native=True)), (k, path)
        for name in ("rng/r0", "rng/r1", "rng/r2", "scheduler"):
            assert _same(snap.object(name), want.object(name)), (k, name)
    net, opt, sched = plain()  # and the chain lands on the next stored step bit for bit
    k = light[0]
    got = run.rebuild(k, net, opt, scheduler=sched, dataset=DATA, loss_fn=loss_fn, check_next=True)
    assert got.landed == min(s for s in run.steps if s > k)


def test_a_ddp_light_step_over_three_ranks_on_other_samples_breaks_the_chain(
    ddp3: tuple[Path, Path],
) -> None:
    _, auto = ddp3
    run = dstt.open(auto)
    k = min(run.light_steps())
    base = max(s for s in run.steps if s < k)
    net, opt, sched = plain()
    swapped = {i: DATA[(i + 1) % len(DATA)] for i in range(len(DATA))}

    def shifted(ix: list[int]) -> Any:  # every sample one further on, for every rank
        from torch.utils.data import default_collate

        return default_collate([swapped[i] for i in ix])

    with pytest.raises(ReplayError, match=rf"the chain broke at step {base + 1}:"):
        run.rebuild(k, net, opt, scheduler=sched, batches=shifted, loss_fn=loss_fn)


def test_a_three_rank_rebuild_of_objects_that_do_not_pickle_says_what_to_pass(
    ddp3: tuple[Path, Path],
) -> None:
    _, auto = ddp3
    net, opt, _ = plain()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0)  # a lambda: not picklable
    run = dstt.open(auto)
    with pytest.raises(ConfigError, match=r"cannot be pickled.*top level of an importable"):
        run.rebuild(
            min(run.light_steps()), net, opt, scheduler=sched, dataset=DATA, loss_fn=loss_fn
        )
