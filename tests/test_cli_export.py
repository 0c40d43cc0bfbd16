"""``dstt export``: torch files whose parts torch's own ``load_state_dict`` accepts, missing
folders created, no silent overwrite (``--force``), ordinary file permissions."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dstt
from dstt.cli import EXIT_BAD_INPUT, EXIT_OK, main


def _build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    model[2].to(torch.bfloat16)
    opt = torch.optim.AdamW(
        [
            {"params": model[0].parameters()},
            {"params": [*model[1].parameters(), *model[2].parameters()], "lr": 2e-2},
        ],
        lr=1e-2,
    )
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    path = tmp_path_factory.mktemp("export") / "run"
    model, opt, sched = _build(0)
    at2: dict[str, Any] = {}
    with dstt.session(model, opt, run=path, scheduler=sched) as s:
        for i in range(3):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(6, 4, generator=g)
            model[2](model[1](model[0](x)).bfloat16()).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            if s.step == 2:
                at2 = {
                    "model": copy.deepcopy(model.state_dict()),
                    "optimizer": copy.deepcopy(opt.state_dict()),
                    "scheduler": sched.state_dict(),
                }
    return path, at2


@pytest.fixture
def umask022() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_torch_export_loads_with_torch_own_load_state_dict(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, at2 = trained
    out = tmp_path / "step2.pt"
    code, text, err = _cli(
        capsys, "export", "--run", str(path), "--step", "2", "--format", "torch", "-o", str(out)
    )
    assert code == EXIT_OK, err
    assert "model, optimizer, scheduler" in text
    doc = torch.load(out, weights_only=True)
    assert set(doc) == {"model", "optimizer", "scheduler"}
    model, opt, sched = _build(seed=9)
    assert model.load_state_dict(doc["model"]) == ([], [])  # strict: every key, no extra
    opt.load_state_dict(doc["optimizer"])
    sched.load_state_dict(doc["scheduler"])
    for k, v in at2["model"].items():
        got = model.state_dict()[k]
        assert got.dtype == v.dtype, k
        assert torch.equal(got, v), k
    assert opt.state_dict()["param_groups"] == at2["optimizer"]["param_groups"]
    for i, st in at2["optimizer"]["state"].items():
        for key, v in st.items():
            assert torch.equal(opt.state_dict()["state"][i][key], v), (i, key)
    assert sched.state_dict() == at2["scheduler"]


def test_export_creates_missing_folders(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = trained
    for fmt, name in (("safetensors", "m.safetensors"), ("torch", "m.pt")):
        out = tmp_path / "new" / fmt / name
        code, _, err = _cli(capsys, "export", "--run", str(path), "--format", fmt, "-o", str(out))
        assert code == EXIT_OK, err
        assert out.is_file()
        assert err == ""
        assert sorted(os.listdir(out.parent)) == [name]  # no temporary file left behind


def test_export_refuses_to_overwrite_without_force(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    path, at2 = trained
    out = tmp_path / "m.safetensors"
    assert _cli(capsys, "export", "--run", str(path), "--step", "2", "-o", str(out))[0] == 0
    before = out.read_bytes()
    code, _, err = _cli(capsys, "export", "--run", str(path), "--step", "3", "-o", str(out))
    assert code == EXIT_BAD_INPUT
    assert "exists" in err
    assert "--force" in err
    assert "Traceback" not in err
    assert out.read_bytes() == before
    code, _, err = _cli(
        capsys, "export", "--run", str(path), "--step", "3", "-o", str(out), "--force"
    )
    assert code == EXIT_OK, err
    assert not torch.equal(load_file(out)["0.weight"], at2["model"]["0.weight"])
    # a folder (an existing one, or a new path ending in '/') gets step<S>.<ext> written in it
    code, _, err = _cli(capsys, "export", "--run", str(path), "--step", "2", "-o", str(tmp_path))
    assert code == EXIT_OK, err
    assert torch.equal(
        load_file(tmp_path / "step2.safetensors")["0.weight"], at2["model"]["0.weight"]
    )
    code, _, err = _cli(capsys, "export", "--run", str(path), "--step", "2", "-o", str(tmp_path))
    assert code == EXIT_BAD_INPUT
    assert "step2.safetensors exists" in err
    new = tmp_path / "exp" / "newdir"
    code, _, err = _cli(
        capsys, "export", "--run", str(path), "--step", "2", "--format", "torch", "-o", f"{new}/"
    )
    assert code == EXIT_OK, err
    assert sorted(os.listdir(new)) == ["step2.pt"]
    with pytest.raises(dstt.OutputExistsError, match="overwrite=True"):
        dstt.open(path).at(2).export(out)
    assert isinstance(dstt.OutputExistsError("x"), FileExistsError)


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_exported_files_have_ordinary_permissions(
    trained: tuple[Path, dict[str, Any]],
    tmp_path: Path,
    umask022: None,
    capsys: pytest.CaptureFixture[str],
    fmt: str,
) -> None:
    path, _ = trained
    out = tmp_path / f"m.{fmt}"
    assert _cli(capsys, "export", "--run", str(path), "--format", fmt, "-o", str(out))[0] == 0
    assert os.stat(out).st_mode & 0o777 == 0o644
    os.umask(0o027)
    out2 = tmp_path / f"m2.{fmt}"
    assert _cli(capsys, "export", "--run", str(path), "--format", fmt, "-o", str(out2))[0] == 0
    assert os.stat(out2).st_mode & 0o777 == 0o640


def test_dcp_export_exits_0(
    trained: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It wrote a correct folder and then ended in 'internal error' (exit 4)."""
    import torch.distributed.checkpoint as dcp

    path, at2 = trained
    out = tmp_path / "dcp2"
    code, text, err = _cli(
        capsys, "export", "--run", str(path), "--step", "2", "--format", "dcp", "-o", str(out)
    )
    assert code == EXIT_OK, err
    assert "dcp" in text
    assert str(out) in text
    model, _, _ = _build(seed=9)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(out))
    for k, v in at2["model"].items():
        assert torch.equal(state["model"][k], v), k
