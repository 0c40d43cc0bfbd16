"""``Snapshot.state_dict()`` and ``Snapshot.load_into``: a step back in torch's own formats.

A small model (two optimizer param groups, a bfloat16 layer, BatchNorm buffers including an
int64 counter) is trained with AdamW and a StepLR scheduler under ``dstt.session``; the loop
records deep copies of ``model/optimizer/scheduler.state_dict()`` at the end of every
iteration. The run must give back exactly those, and loading a step into fresh objects and
training on must give exactly the original run's next step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import dstt
from dstt.errors import SchemaError

STEPS = 4


class Net(nn.Module):
    def __init__(self, seed: int, wide: int = 6) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(4, wide)
        self.norm = nn.BatchNorm1d(wide)
        self.out = nn.Linear(wide, 3).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.inp(x)))
        return self.out(h.bfloat16()).float()


def build(seed: int) -> tuple[Net, torch.optim.Optimizer, Any]:
    model = Net(seed)
    opt = torch.optim.AdamW(
        [
            {"params": model.inp.parameters()},
            {
                "params": [*model.norm.parameters(), *model.out.parameters()],
                "lr": 3e-2,
                "weight_decay": 0.0,
            },
        ],
        lr=1e-2,
    )
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)


def iteration(model: nn.Module, opt: torch.optim.Optimizer, sched: Any, i: int) -> None:
    x, y = batch(i)
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "scheduler": sched.state_dict(),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    path = tmp_path_factory.mktemp("restore") / "run"
    model, opt, sched = build(0)
    seen: dict[int, dict[str, Any]] = {}
    with dstt.session(model, opt, run=path, scheduler=sched) as s:
        for i in range(STEPS):
            iteration(model, opt, sched, i)
            seen[s.step] = snapshot(model, opt, sched)
    return path, seen


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        assert got[k].shape == v.shape, k
        assert torch.equal(got[k], v), k


def assert_same_optimizer(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"])
    for i, st in want["state"].items():
        assert_same_tensors(got["state"][i], st)


@pytest.mark.parametrize("k", [1, 3])
def test_state_dict_is_what_torch_gave_at_that_step(
    trained: tuple[Path, dict[int, dict[str, Any]]], k: int
) -> None:
    path, seen = trained
    sd = dstt.open(path).at(k).state_dict()
    want = seen[k]
    assert set(sd) == {"model", "optimizer", "scheduler"}
    assert_same_tensors(sd["model"], want["model"])  # same names, order, dtypes, bits
    assert sd["model"]["out.weight"].dtype == torch.bfloat16
    assert sd["model"]["norm.num_batches_tracked"].dtype == torch.int64
    assert_same_optimizer(sd["optimizer"], want["optimizer"])
    assert len(sd["optimizer"]["param_groups"]) == 2
    assert sd["optimizer"]["param_groups"][0]["lr"] != sd["optimizer"]["param_groups"][1]["lr"]
    assert sd["scheduler"] == want["scheduler"]


def test_load_into_fresh_objects_continues_bit_exactly(
    trained: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    path, seen = trained
    k = 2
    model, opt, sched = build(seed=7)  # other initial weights, no optimizer state yet
    assert not torch.equal(model.inp.weight, seen[k]["model"]["inp.weight"])
    result = dstt.open(path).at(k).load_into(model, opt, sched)
    assert result == ([], [])
    assert_same_tensors(model.state_dict(), seen[k]["model"])
    assert_same_optimizer(opt.state_dict(), seen[k]["optimizer"])
    assert sched.state_dict() == seen[k]["scheduler"]
    iteration(model, opt, sched, k)  # the loop's iteration k makes step k + 1
    assert_same_tensors(model.state_dict(), seen[k + 1]["model"])
    assert_same_optimizer(opt.state_dict(), seen[k + 1]["optimizer"])
    assert sched.state_dict() == seen[k + 1]["scheduler"]


def test_load_into_a_model_that_does_not_fit_names_the_keys_and_changes_nothing(
    trained: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    path, _ = trained
    snap = dstt.open(path).at(2)
    model = Net(seed=3)
    model.extra = nn.Linear(2, 2)
    del model.norm
    model.norm = nn.Identity()  # type: ignore[assignment]
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SchemaError) as e:
        snap.load_into(model)
    msg = str(e.value)
    assert "missing from the step: extra.bias, extra.weight" in msg
    assert "norm.running_mean" in msg
    assert "not in the model" in msg
    assert "strict=False" in msg
    assert isinstance(e.value, ValueError)
    assert_same_tensors(model.state_dict(), before)
    # strict=False loads what both have and says what it left out
    res = snap.load_into(model, strict=False)
    assert res.missing_keys == ["extra.weight", "extra.bias"]
    assert "norm.weight" in res.unexpected_keys
    assert torch.equal(model.out.weight, snap.state_dict()["model"]["out.weight"])


def test_other_dtypes_or_param_groups_are_refused_before_loading(
    trained: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    path, _ = trained
    snap = dstt.open(path).at(2)
    model = Net(seed=3)
    model.out.float()  # the run's layer is bf16: loading would round, not restore
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(SchemaError, match=r"out\.weight \(stored torch\.bfloat16"):
        snap.load_into(model)
    assert_same_tensors(model.state_dict(), before)

    model, _, _ = build(seed=3)
    one_group = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(SchemaError, match="2 optimizer param groups, the live optimizer has 1"):
        snap.load_into(model, one_group)
    assert_same_tensors(model.state_dict(), build(seed=3)[0].state_dict())
    swapped = torch.optim.AdamW(
        [
            {"params": model.norm.parameters()},  # same sizes, other
            {
                "params": [
                    *model.inp.parameters(),  # parameters
                    *model.out.parameters(),
                ]
            },
        ]
    )
    with pytest.raises(SchemaError, match="param group 0 holds other parameters"):
        snap.load_into(model, swapped)
    assert not swapped.state  # nothing was loaded


def test_tied_parameters_load_under_every_name(tmp_path: Path) -> None:
    from dstt.testing.models import TinyGPT, make_batch

    def fresh(seed: int) -> tuple[TinyGPT, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = TinyGPT(vocab=16, d=8, layers=1, heads=2, seq=4, dropout=0.0)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model: TinyGPT, opt: torch.optim.Optimizer, i: int) -> None:
        x, y = make_batch(i, batch_size=2, seq=4, vocab=16)
        model(x, y)[1].backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()

    model, opt = fresh(0)
    with dstt.session(model, opt, run=tmp_path / "gpt") as s:
        for i in range(3):
            step(model, opt, i)
            if s.step == 2:
                at2 = copy.deepcopy(model.state_dict())
    sd = dstt.open(tmp_path / "gpt").at(2).state_dict()
    assert sd["model"]["head.weight"] is sd["model"]["tok.weight"]  # one tensor, two names
    model2, opt2 = fresh(5)
    dstt.open(tmp_path / "gpt").at(2).load_into(model2, opt2)
    assert model2.head.weight is model2.tok.weight  # still tied
    assert_same_tensors(model2.state_dict(), at2)
    step(model2, opt2, 2)
    assert_same_tensors(model2.state_dict(), model.state_dict())


def test_a_run_without_torch_optimizer_state(tmp_path: Path) -> None:
    from dstt.store import save

    lin = nn.Linear(3, 2)
    save(
        tmp_path / "r",
        1,
        {f"params/{k}": v.detach().numpy().copy() for k, v in lin.state_dict().items()},
    )
    snap = dstt.open(tmp_path / "r").at(1)
    sd = snap.state_dict()
    assert sd["optimizer"] is None
    assert sd["scheduler"] is None
    fresh = nn.Linear(3, 2)
    snap.load_into(fresh)
    np.testing.assert_array_equal(fresh.weight.detach().numpy(), lin.weight.detach().numpy())
    with pytest.raises(SchemaError, match="no torch optimizer state"):
        snap.load_into(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="needs a model"):
        snap.load_into()


def _two_optimizers(seed: int) -> tuple[Net, dict[str, torch.optim.Optimizer]]:
    model = Net(seed)
    return model, {
        "body": torch.optim.SGD(model.inp.parameters(), lr=0.05, momentum=0.9),
        "head": torch.optim.AdamW([*model.norm.parameters(), *model.out.parameters()], lr=1e-2),
    }


def _two_step(model: Net, opts: dict[str, torch.optim.Optimizer], i: int) -> None:
    x, y = batch(i)
    nn.functional.mse_loss(model(x), y).backward()
    for o in opts.values():
        o.step()
        o.zero_grad()


def test_several_optimizers_come_back_by_their_keys(tmp_path: Path) -> None:
    model, opts = _two_optimizers(0)
    with dstt.session(model, opts, run=tmp_path / "run") as s:
        for i in range(3):
            _two_step(model, opts, i)
            if s.step == 2:
                want = {k: copy.deepcopy(o.state_dict()) for k, o in opts.items()}
                at2 = copy.deepcopy(model.state_dict())
    snap = dstt.open(tmp_path / "run").at(2)
    sd = snap.state_dict()
    assert set(sd["optimizer"]) == {"body", "head"}
    for k in want:
        assert_same_optimizer(sd["optimizer"][k], want[k])
    # load_into takes them as the session did (a dict: the same keys) and is exact
    fresh, fresh_opts = _two_optimizers(7)
    res = snap.load_into(fresh, fresh_opts)
    assert_same_tensors(fresh.state_dict(), at2)
    assert res.loaded_keys == list(fresh.state_dict())
    for k, o in fresh_opts.items():
        assert_same_optimizer(o.state_dict(), want[k])
    _two_step(fresh, fresh_opts, 2)  # and trains on into the original step 3
    assert_same_tensors(fresh.state_dict(), model.state_dict())
    # the wrong number or keys of optimizers is refused before anything is loaded
    other, other_opts = _two_optimizers(8)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(
        SchemaError,
        match=r"holds the optimizers 'body', 'head'; given "
        r"optimizers 'body', 'tail'",
    ):
        snap.load_into(other, {"body": other_opts["body"], "tail": other_opts["head"]})
    with pytest.raises(SchemaError, match=r"holds 2 optimizers \('body', 'head'\): pass them"):
        snap.load_into(other, other_opts["body"])
    with pytest.raises(SchemaError, match=r"given a list of '0', '1', '2'"):
        snap.load_into(other, [*other_opts.values(), other_opts["body"]])
    assert_same_tensors(other.state_dict(), before)
    assert not other_opts["body"].state
    assert not other_opts["head"].state


def test_a_list_of_optimizers_loads_as_a_list(tmp_path: Path) -> None:
    model, opts = _two_optimizers(0)
    with dstt.session(model, list(opts.values()), run=tmp_path / "run"):
        for i in range(2):
            _two_step(model, opts, i)
    snap = dstt.open(tmp_path / "run").at(2)
    assert set(snap.state_dict()["optimizer"]) == {"0", "1"}
    fresh, fresh_opts = _two_optimizers(3)
    snap.load_into(fresh, list(fresh_opts.values()))
    assert_same_optimizer(fresh_opts["head"].state_dict(), opts["head"].state_dict())
    with pytest.raises(SchemaError, match="holds the optimizers '0', '1'"):
        snap.load_into(fresh, {"body": fresh_opts["body"], "head": fresh_opts["head"]})


def test_load_into_with_strict_false_warns_when_nothing_fits(
    trained: tuple[Path, dict[int, dict[str, Any]]],
) -> None:
    from dstt.errors import DsttWarning

    path, _ = trained
    snap = dstt.open(path).at(2)
    stranger = nn.Sequential(nn.Linear(2, 2))
    with pytest.warns(
        DsttWarning,
        match=r"loaded nothing into the model: none of its 2 "
        r"names \(e\.g\. '0\.weight'\) is stored at step 2",
    ):
        res = snap.load_into(stranger, strict=False)
    assert res.loaded_keys == []
    assert res.missing_keys == ["0.weight", "0.bias"]
    assert "loaded_keys=''" in repr(res)
    missing, unexpected = res  # still torch's pair
    assert missing == ["0.weight", "0.bias"]
    assert "inp.weight" in unexpected
