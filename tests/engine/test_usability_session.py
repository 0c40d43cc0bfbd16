"""What a new user trips on in ``dstt.session`` (issue 15): where ``s.log`` sits, ``every=K``
losing the end of training, an optimizer that does not hold the model's parameters, the
update ratio after a resume, and the session modules' import graph."""

from __future__ import annotations

import ast
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.errors import ConfigError, DsttWarning
from dstt.store import Repository
from dstt.training import session

from ._helpers import MLP, committed_steps, mlp_batch, same_bits


def _train(
    run: Path, n: int, *, placement: str, every: int = 1, resume: bool = False, seed: int = 0
) -> list[float]:
    """``n`` steps of the same loop, logging the loss before or after ``optimizer.step()``."""
    torch.manual_seed(seed)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    with session(m, opt, run=run, every=every, resume=resume) as s:
        for i in range(s.step, s.step + n):
            _, loss = m(*mlp_batch(i))
            loss.backward()
            losses.append(float(loss.item()))
            if placement == "before":
                s.log(loss=loss)
            elif placement == "explicit":
                s.log(step=i + 1, loss=loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if placement == "after":
                s.log(loss=loss)
    return losses


def _curve(run: Path) -> tuple[list[int], list[float]]:
    ds = dstt.open(run).metrics()
    return [int(k) for k in ds["step"].values], [float(v) for v in ds["loss"].values]


@pytest.mark.parametrize("placement", ["before", "explicit"])
def test_log_before_step_gives_the_same_curve_as_log_after_step(
    tmp_path: Path, placement: str
) -> None:
    after = _train(tmp_path / "after", 5, placement="after")
    got = _train(tmp_path / placement, 5, placement=placement)
    assert got == after  # the same training
    steps, values = _curve(tmp_path / placement)
    assert (steps, values) == _curve(tmp_path / "after")
    assert steps == [1, 2, 3, 4, 5]
    assert values == after  # iteration i's loss under step i, the first one included


def test_log_placement_is_learned_again_after_a_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = _train(run, 3, placement="before")
    second = _train(run, 2, placement="before", resume=True, seed=1)
    steps, values = _curve(run)
    assert steps == [1, 2, 3, 4, 5]
    assert values == first + second


def test_metrics_logged_after_the_last_step_join_it(tmp_path: Path) -> None:
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    with session(m, opt, run=tmp_path / "run") as s:
        for i in range(2):
            _, loss = m(*mlp_batch(i))
            loss.backward()
            s.log(loss=loss)
            opt.step()
            opt.zero_grad()
        s.log(eval_loss=0.5, loss=123.0)  # an eval after the loop: kept, loss not overwritten
    ds = dstt.open(tmp_path / "run").metrics()
    assert list(ds["eval_loss"].values[-1:]) == [0.5]
    assert ds["loss"].values[-1] != 123.0


def test_every_k_commits_the_end_and_keeps_every_steps_metrics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    losses = _train(run, 12, placement="after", every=5)
    assert committed_steps(Repository.open(run)) == [5, 10, 12]
    steps, values = _curve(run)
    assert steps == list(range(1, 13))
    assert values == losses
    ds = dstt.open(run).metrics()
    assert [int(x) for x in ds["slot"].values if x >= 0] == [
        h.slot for h in Repository.open(run).reader().lineage()
    ]


def test_every_k_resumes_from_the_step_committed_at_close(tmp_path: Path) -> None:
    run = tmp_path / "run"
    torch.manual_seed(0)
    m = MLP()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    with session(m, opt, run=run, every=5) as s:
        for i in s.data(range(7)):
            _, loss = m(*mlp_batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    m2 = MLP()
    opt2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    with session(m2, opt2, run=run, every=5, resume=True) as s2:
        assert s2.step == 7
        assert list(s2.data(range(9))) == [7, 8]  # the 7 consumed batches are skipped
    for p, q in zip(m.parameters(), m2.parameters(), strict=True):
        assert same_bits(p, q)
    for a, b in zip(opt.state.values(), opt2.state.values(), strict=True):
        assert same_bits(a["exp_avg"], b["exp_avg"])


def test_an_interrupt_commits_the_last_finished_step(tmp_path: Path) -> None:
    """Ctrl-C in the forward of step 8 (every=5): step 7 finished, so it is committed with
    the step state taken after its optimizer step (data position 7, not 8)."""
    run = tmp_path / "run"
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    after7 = None
    with pytest.raises(KeyboardInterrupt), session(m, opt, run=run, every=5) as s:
        for i in s.data(range(100)):
            if s.step == 7:
                raise KeyboardInterrupt
            _, loss = m(*mlp_batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad()
            after7 = m.l1.weight.detach().clone()
    repo = Repository.open(run)
    assert committed_steps(repo) == [5, 7]
    r = repo.reader()
    assert r.read_object(r.head(), "data") == {"epoch": 0, "batch": 7, "total": 7}
    m2 = MLP()
    with session(m2, torch.optim.SGD(m2.parameters(), lr=1e-2), run=run, resume=True):
        pass
    assert after7 is not None
    assert same_bits(m2.l1.weight, after7)

    # but an interrupt inside optimizer step 8 (tensors half-updated) commits nothing more
    run = tmp_path / "run2"
    m = MLP()
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)

    def interrupt(*_: object) -> None:
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt

    calls: list[int] = []
    with pytest.raises(KeyboardInterrupt), session(m, opt, run=run, every=5) as s:
        opt.register_step_pre_hook(interrupt)  # after the session's: its step has begun
        for i in s.data(range(100)):
            _, loss = m(*mlp_batch(i))
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert committed_steps(Repository.open(run)) == [5]
    assert len(calls) == 8


def test_an_optimizer_over_another_model_is_refused(tmp_path: Path) -> None:
    m, other = MLP(), MLP()
    with pytest.raises(ConfigError, match="not the model's"):
        session(m, torch.optim.SGD(other.parameters(), lr=0.1), run=tmp_path / "a")
    extra = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ConfigError, match="not the model's"):
        session(m, torch.optim.SGD([*m.parameters(), extra], lr=0.1), run=tmp_path / "b")
    assert issubclass(ConfigError, ValueError)


def test_an_optimizer_missing_trainable_params_warns_and_frozen_ones_are_fine(
    tmp_path: Path,
) -> None:
    m = MLP()
    with pytest.warns(DsttWarning, match="l2.weight"):
        session(m, torch.optim.SGD(m.l1.parameters(), lr=0.1), run=tmp_path / "a")
    m.l2.requires_grad_(False)  # frozen layers left out of the optimizer: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        session(m, torch.optim.SGD(m.l1.parameters(), lr=0.1), run=tmp_path / "b")


def test_an_empty_optimizer_is_refused(tmp_path: Path) -> None:
    m = MLP()
    frozen = torch.nn.Linear(2, 2)
    frozen.requires_grad_(False)
    m.add_module("frozen", frozen)
    opt = torch.optim.SGD(m.frozen.parameters(), lr=0.1)  # only frozen params: none trained
    with pytest.raises(ConfigError, match="none of the model's"):
        session(m, opt, run=tmp_path / "a")


@pytest.mark.parametrize("budget", [256 * 1024 * 1024, 8192])  # flat lane, chunk lane
def test_update_ratio_is_known_at_the_first_step_after_a_resume(
    tmp_path: Path, budget: int
) -> None:
    def run_steps(run: Path, n: int, resume: bool) -> None:
        torch.manual_seed(0)
        m = MLP()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        with session(m, opt, run=run, resume=resume, budget_bytes=budget) as s:
            for i in range(s.step, s.step + n):
                _, loss = m(*mlp_batch(i))
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    run_steps(tmp_path / "whole", 5, False)
    run_steps(tmp_path / "resumed", 3, False)
    run_steps(tmp_path / "resumed", 2, True)
    whole_ds = dstt.open(tmp_path / "whole").summaries()
    resumed_ds = dstt.open(tmp_path / "resumed").summaries()
    whole, resumed = whole_ds["update_ratio"], resumed_ds["update_ratio"]
    at4 = resumed.sel(step=4).values
    assert np.all(np.isfinite(at4))
    assert np.all(at4 > 0)
    if bool(whole_ds["update_exact"].sel(step=4).all()):
        # flat lane: the uninterrupted run's step 4 is exact; the first step after a resume
        # is the probe estimate (its parent's copy was never digested), labelled as such
        assert not bool(resumed_ds["update_exact"].sel(step=4).any())
        np.testing.assert_allclose(at4, whole.sel(step=4).values, rtol=0.25)
        assert bool(resumed_ds["update_exact"].sel(step=5).all())  # exact again after it
    else:  # chunk lane: both are the same probe estimate
        np.testing.assert_allclose(at4, whole.sel(step=4).values, rtol=1e-12)
    assert not math.isfinite(float(resumed.sel(step=1).values[0]))  # a run's first: unknown


def _imports(path: Path, package: str) -> set[str]:
    """dstt modules a source file imports anywhere in it (functions included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            out.add(f"dstt.{package}.{node.module}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dstt."):
            out.add(node.module or "")
    return out


def test_the_session_modules_import_one_way() -> None:
    """No cycle between the training package's modules, function-level imports included."""
    root = Path(dstt.__file__).parent / "training"
    names = [p.stem for p in root.glob("*.py") if p.stem != "__init__"]
    mods = {f"dstt.training.{n}" for n in names}
    graph = {
        f"dstt.training.{n}": {i for i in _imports(root / f"{n}.py", "training") if i in mods}
        for n in names
    }
    for a, deps in graph.items():
        for b in deps:
            assert a not in graph.get(b, set()), f"{a} <-> {b}"
    assert dstt.session is session
    assert dstt.Session.__module__ == "dstt.training.session"
