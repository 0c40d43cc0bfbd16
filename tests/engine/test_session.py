"""The PyTorch session against a real run directory: hooks, races, exceptions, resume."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import RaceError, TimelineError
from dstt.inspect.summaries import summary_rows
from dstt.store import Repository
from dstt.testing.models import SyntheticBatches, TinyGPT
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, same_bits, stored, train_step


def test_every_step_is_committed_with_its_logged_metrics(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    after: dict[int, torch.Tensor] = {}
    with session(m, opt, run=tmp_path / "run") as s:
        assert s.step == 0
        for i in range(5):
            loss = train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l1.weight.detach().clone()
            s.log(loss=loss, tensor_metric=torch.tensor(2.0))
    assert s.step == 5
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3, 4, 5]
    r = repo.reader()
    for h in r.lineage():
        assert set(h.metrics) == {"loss", "tensor_metric"}
        assert same_bits(stored(repo, h.step, "params/l1/weight"), after[h.step])
    assert [x.step for x in s.metrics] == [1, 2, 3, 4, 5]
    assert all(x.committed and x.bytes > 0 and x.error is None for x in s.metrics)


def test_every_n_captures_only_multiples(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run", every=3) as s:
        for i in range(10):
            train_step(m, opt, *mlp_batch(i))
    assert s.step == 10
    # multiples of 3, and the last step at close (the end of training is never lost)
    assert committed_steps(Repository.open(tmp_path / "run")) == [3, 6, 9, 10]
    with session(MLP(), None, run=tmp_path / "run", resume=True, every=3) as s2:
        assert s2.step == 10


def test_a_run_with_steps_needs_resume(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run"):
        train_step(m, opt, *mlp_batch(0))
    with pytest.raises(TimelineError, match="resume=True"), session(m, opt, run=tmp_path / "run"):
        pass
    with session(m, opt, run=tmp_path / "run", resume=True) as s:  # the lock was released
        assert s.step == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_budget_smaller_than_the_largest_tensor(tmp_path: Path, dtype: torch.dtype) -> None:
    big = MLP(d_in=256, hidden=512).to(dtype)  # l1.weight: 512x256 = 512 KiB in fp32
    opt = torch.optim.Adam(big.parameters(), lr=1e-3)
    budget = 64 * 1024
    assert big.l1.weight.numel() * big.l1.weight.element_size() >= 4 * budget
    want: dict[int, dict[str, torch.Tensor]] = {}
    with session(big, opt, run=tmp_path / "run", budget_bytes=budget) as s:
        for i in range(3):
            train_step(big, opt, *mlp_batch(i, d_in=256, dtype=dtype))
            st = opt.state[big.l1.weight]
            want[s.step] = {
                "params/l1/weight": big.l1.weight.detach().clone(),
                "optim/exp_avg/l1/weight": st["exp_avg"].clone(),
                "optim/exp_avg_sq/l1/weight": st["exp_avg_sq"].clone(),
            }
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3]
    for step, tensors in want.items():
        for path, t in tensors.items():
            assert same_bits(stored(repo, step, path), t), (step, path)
    for x in s.metrics:
        assert x.cache_capacity <= budget
        assert x.cache_peak_bytes <= x.cache_capacity


def _mutating_hook(module: torch.nn.Module, armed: list[bool], how: str, seen: list):
    def hook(mod: torch.nn.Module, args: object) -> None:
        if armed[0]:
            armed[0] = False
            with torch.no_grad():
                if how == "inplace":
                    mod.weight.add_(0.5)  # bumps the version counter
                else:
                    mod.weight.data.add_(0.5)  # bypasses it
            seen.append(mod.weight.detach().clone())

    return module.register_forward_pre_hook(hook)


def _race_run(tmp_path: Path, how: str, **kw: object) -> tuple[Path, list]:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    armed, seen = [False], []
    _mutating_hook(m.l1, armed, how, seen)
    run = tmp_path / "run"
    with session(m, opt, run=run, **kw):
        train_step(m, opt, *mlp_batch(0))  # step 1 staged; its copy window opens
        armed[0] = True
        train_step(m, opt, *mlp_batch(1))  # forward writes l1.weight; step 2's pre-hook checks
    return run, seen


def test_in_place_write_in_the_copy_window_raises_race_error(tmp_path: Path) -> None:
    with pytest.raises(RaceError, match=r"params/l1/weight") as info:
        _race_run(tmp_path, "inplace")
    assert "race_policy" in str(info.value)
    assert committed_steps(Repository.open(tmp_path / "run")) == []  # step 1 never committed


def test_race_policy_recopy_commits_the_value_seen_by_the_next_step(tmp_path: Path) -> None:
    run, seen = _race_run(tmp_path, "inplace", race_policy="recopy")
    repo = Repository.open(run)
    assert committed_steps(repo) == [1, 2]
    assert same_bits(stored(repo, 1, "params/l1/weight"), seen[0])
    r = repo.reader()  # the write-time summary describes the recopied values, once
    summary = summary_rows(r.read_object(r.find(1), "summaries"))["params/l1/weight"]
    assert summary["l2"] == pytest.approx(float(seen[0].double().norm()), rel=1e-6)


def test_race_policy_warn_commits_and_warns(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning, match="modified in place"):
        run, _ = _race_run(tmp_path, "inplace", race_policy="warn")
    assert committed_steps(Repository.open(run)) == [1, 2]


def test_data_write_is_invisible_without_verify_and_caught_with_it(tmp_path: Path) -> None:
    run, _ = _race_run(tmp_path / "a", "data")  # the version counter cannot see .data writes
    assert committed_steps(Repository.open(run)) == [1, 2]
    with pytest.raises(RaceError, match=r"params/l1/weight.*\.data"):
        _race_run(tmp_path / "b", "data", verify=True)
    assert committed_steps(Repository.open(tmp_path / "b" / "run")) == []


def test_verify_mode_passes_clean_training(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.AdamW(m.parameters())
    with session(m, opt, run=tmp_path / "run", verify=True):
        for i in range(3):
            train_step(m, opt, *mlp_batch(i))
    assert committed_steps(Repository.open(tmp_path / "run")) == [1, 2, 3]


def test_exception_inside_the_block_leaves_only_whole_steps(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    after: dict[int, torch.Tensor] = {}
    with (
        pytest.raises(KeyboardInterrupt),
        session(m, opt, run=tmp_path / "run", scheduler=sched) as s,
    ):
        for i in range(4):
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = m.l2.weight.detach().clone()
            if i < 3:
                sched.step()
        raise KeyboardInterrupt  # step 4 updated, but its scheduler step not taken yet
    repo = Repository.open(tmp_path / "run")
    steps = committed_steps(repo)
    assert steps == [1, 2, 3]  # step 4 is dropped whole, never half-written
    for step in steps:
        assert same_bits(stored(repo, step, "params/l2/weight"), after[step])
    assert repo.verify().problems == []
    m2 = MLP()
    with session(m2, torch.optim.AdamW(m2.parameters()), run=tmp_path / "run", resume=True) as s2:
        assert s2.step == 3
    assert same_bits(m2.l2.weight, after[3])


@pytest.mark.parametrize("every", [1, 4])
def test_an_exception_after_a_finished_step_commits_it_with_its_metrics(
    tmp_path: Path, every: int
) -> None:
    """Raised after step 6's optimizer step, scheduler step and s.log (in logging or eval
    code): step 6 is the last finished step, so it is committed with its metrics (and with
    every=4 the metrics of step 5 ride with it)."""
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    with (
        pytest.raises(RuntimeError, match="eval broke"),
        session(m, opt, run=tmp_path / "run", scheduler=sched, every=every) as s,
    ):
        for i in range(6):
            loss = train_step(m, opt, *mlp_batch(i))
            sched.step()
            s.log(loss=float(loss))
        after6 = m.l2.weight.detach().clone()
        lr6 = sched.get_last_lr()
        raise RuntimeError("eval broke")
    run = dstt.open(tmp_path / "run")
    assert run.steps[-1] == 6
    assert list(run.metrics()["loss"].dropna("step")["step"].values) == [1, 2, 3, 4, 5, 6]
    m2 = MLP()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.9)
    with session(m2, opt2, run=tmp_path / "run", scheduler=sched2, resume=True) as s2:
        assert s2.step == 6
    assert same_bits(m2.l2.weight, after6)
    assert sched2.get_last_lr() == lr6


def _gpt(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    m = TinyGPT(layers=1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    return m, opt, sched


def _iterate(m, opt, sched, s, data, n: int) -> list[float]:
    losses = []
    for x, y in data:
        losses.append(train_step(m, opt, x, y))
        sched.step()
        if s is not None:
            s.log(loss=losses[-1])
        if len(losses) == n:
            break
    return losses


def test_resume_in_process_is_bit_exact(tmp_path: Path) -> None:
    m, opt, sched = _gpt(0)
    batches = SyntheticBatches(20)
    with session(m, opt, run=tmp_path / "run", scheduler=sched) as s:
        it = iter(s.data(batches))
        _iterate(m, opt, sched, s, it, 6)
    # the uninterrupted continuation (same objects, same RNG stream, same iterator)
    expected = _iterate(m, opt, sched, None, it, 4)

    m2, opt2, sched2 = _gpt(123)  # different init, fresh optimizer and scheduler
    torch.manual_seed(999)  # and a different global RNG
    with session(m2, opt2, run=tmp_path / "run", scheduler=sched2, resume=True) as s2:
        assert s2.step == 6
        got = _iterate(m2, opt2, sched2, s2, s2.data(batches), 4)
    assert got == expected
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert same_bits(p, q)


def test_rollback_skip_data_skips_batches_on_resume(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run") as s:
        for i in s.data(range(100)):
            train_step(m, opt, *mlp_batch(i))
            if s.step == 6:
                break
    Repository.open(tmp_path / "run").rollback(to_step=3, skip_data=2)
    seen = []
    with session(m, opt, run=tmp_path / "run", resume=True) as s:
        assert s.step == 3
        for i in s.data(range(100)):
            seen.append(i)
            train_step(m, opt, *mlp_batch(i))
            break
    assert seen == [5]  # 3 consumed + 2 skipped
    r = Repository.open(tmp_path / "run").reader()
    assert r.read_object(r.head(), "data") == {"epoch": 0, "batch": 6, "total": 6}


def test_no_warnings_in_a_clean_run(tmp_path: Path) -> None:
    m, opt, sched = _gpt(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with session(m, opt, run=tmp_path / "run", scheduler=sched) as s:
            _iterate(m, opt, sched, s, s.data(SyntheticBatches(3)), 3)


class _BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.l2(self.bn(self.l1(x)))
        return out, torch.nn.functional.mse_loss(out, y)


def test_buffers_updated_in_forward_are_not_races(tmp_path: Path) -> None:
    """BatchNorm writes its running stats in forward, inside the copy window: legitimate."""
    m = _BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    after: dict[int, dict[str, torch.Tensor]] = {}
    with session(m, opt, run=tmp_path / "run") as s:
        for i in range(4):
            train_step(m, opt, *mlp_batch(i))
            after[s.step] = {k: v.clone() for k, v in m.state_dict().items()}
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3, 4]
    for step, sd in after.items():
        assert same_bits(stored(repo, step, "buffers/bn/running_mean"), sd["bn.running_mean"])
        assert same_bits(
            stored(repo, step, "buffers/bn/num_batches_tracked"), sd["bn.num_batches_tracked"]
        )


class _Counter:
    def __init__(self) -> None:
        self.n, self.history = 0, [0.5]

    def state_dict(self) -> dict[str, object]:
        return {"n": self.n, "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.n, self.history = state["n"], list(state["history"])


def test_extra_state_round_trips(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    counter = _Counter()
    with session(m, opt, run=tmp_path / "run", extra_state={"counter": counter}):
        for i in range(3):
            train_step(m, opt, *mlp_batch(i))
            counter.n += 1
            counter.history.append(float(i))
    fresh = _Counter()
    with session(
        MLP(), None, run=tmp_path / "run", resume=True, extra_state={"counter": fresh}
    ) as s:
        assert s.step == 3
    # captured at the end of iteration 3 (here: the clean exit), after the loop body's update
    assert fresh.n == 3
    assert fresh.history == [0.5, 0.0, 1.0, 2.0]


def test_boundary_state_is_taken_before_the_next_batch(tmp_path: Path) -> None:
    """With ``s.data``, the end of iteration k is when batch k+1 is requested: state changed
    after that (here: by an exception mid-iteration) is not part of step k, and step k still
    commits because its iteration finished."""
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    counter = _Counter()
    with (
        pytest.raises(ValueError, match="mid-iteration"),
        session(
            m, opt, run=tmp_path / "run", scheduler=sched, extra_state={"counter": counter}
        ) as s,
    ):
        for i in s.data(range(100)):
            counter.history.append(float(i))  # changes after the boundary of step i
            if s.step == 3:
                raise ValueError("mid-iteration")
            train_step(m, opt, *mlp_batch(i))
            sched.step()
            counter.n += 1
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2, 3]
    r = repo.reader()
    h = r.head()
    assert r.read_object(h, "extra/counter") == {"n": 3, "history": [0.5, 0.0, 1.0, 2.0]}
    assert r.read_object(h, "scheduler")["last_epoch"] == 3
    assert r.read_object(h, "data")["batch"] == 3


def test_manual_steps_without_an_optimizer(tmp_path: Path) -> None:
    m = MLP()
    values = {}
    with session(m, None, run=tmp_path / "run") as s:
        for _ in range(3):
            s.wait()  # the previous step's copies are done: safe to write the tensors
            with torch.no_grad():
                m.l1.weight.add_(1.0)
            s.mark_step()
            values[s.step] = m.l1.weight.detach().clone()
        with torch.no_grad():
            m.l1.weight.add_(1.0)  # forgot s.wait(): the guard notices
        with pytest.raises(RaceError):
            s.mark_step()
    repo = Repository.open(tmp_path / "run")
    assert committed_steps(repo) == [1, 2]  # step 3 raced, so it was dropped
    for step in (1, 2):
        assert same_bits(stored(repo, step, "params/l1/weight"), values[step])


def test_a_slow_disk_stalls_training_instead_of_exceeding_the_budget(tmp_path: Path) -> None:
    import time

    from dstt.store.storage.memory import FaultyStorage, MemoryStorage

    inner = MemoryStorage()
    Repository.create(inner)
    slow = FaultyStorage(inner, on_write=lambda key: time.sleep(0.002))
    big = MLP(d_in=64, hidden=512)
    opt = torch.optim.Adam(big.parameters())
    budget = 64 * 1024  # a step is ~400 KiB of tensors
    with session(big, opt, run=Repository(slow), budget_bytes=budget, max_backlog=2) as s:
        for i in range(6):
            train_step(big, opt, *mlp_batch(i, d_in=64))
    assert committed_steps(Repository(inner)) == [1, 2, 3, 4, 5, 6]
    assert all(x.cache_peak_bytes <= x.cache_capacity <= budget for x in s.metrics)
    assert sum(x.stall_s for x in s.metrics) > 0  # the copy thread had to wait for slabs
    assert max(x.backlog for x in s.metrics) <= 2


def test_write_time_summaries_match_the_committed_tensors(tmp_path: Path) -> None:
    import math

    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run", budget_bytes=8192):  # several chunks/tensor
        for i in range(3):
            train_step(m, opt, *mlp_batch(i))
    repo = Repository.open(tmp_path / "run")
    r = repo.reader()
    for h in r.lineage():
        summ = summary_rows(r.read_object(h, "summaries"))
        assert set(summ) == {
            "params/l1/weight",
            "params/l1/bias",
            "params/l2/weight",
            "params/l2/bias",
        }
        w = stored(repo, h.step, "params/l1/weight").double()
        assert math.isclose(summ["params/l1/weight"]["l2"], float(w.norm()), rel_tol=1e-6)
        assert summ["params/l1/weight"]["nan"] == 0
        assert (summ["params/l1/weight"]["update_l2"] is None) == (h.step == 1)
    with session(m, opt, run=tmp_path / "run", resume=True, summaries=False):
        train_step(m, opt, *mlp_batch(3))
    assert "summaries" not in Repository.open(tmp_path / "run").reader().head().objects
