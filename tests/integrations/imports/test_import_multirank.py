"""DCP folders and DeepSpeed tags written by 1 and 2 real gloo ranks, imported into runs; and
``export --format dcp`` loaded back by DCP on 1 and 2 ranks.

References are each framework's own view of the state, not dstt's reading of the files: DCP's
``get_state_dict(full_state_dict=True)`` gathered at save time, and DeepSpeed's
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` on the live engine. Proves:
every logical tensor (FSDP2 shards, ZeRO-2/3 partitions reassembled) and every optimizer state
is bit-exact at every imported step; the step comes from the checkpoint; a resume from an
imported DCP step continues exactly as ``dcp.load`` into the model does; a DeepSpeed tag with a
rank's optimizer file missing is reported and skipped; the DCP export of an imported step is
what ``dcp.load`` + ``set_state_dict`` puts into a fresh model and optimizer, bit for bit, on
one process and on two FSDP2 ranks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import dstt
from dstt.integrations.imports import import_checkpoints

pytest.importorskip("deepspeed")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_folders_import_bit_exact(
    multirank: dict[str, Path], tmp_path: Path, world: int
) -> None:
    src = multirank[f"dcp{world}"]
    report = import_checkpoints(src, tmp_path / "run")
    assert [i.step for i in report.imported] == [2, 3]
    assert report.ok
    assert [u.path.endswith(".pt") for u in report.ignored] == [True, True]  # the references
    run = dstt.open(tmp_path / "run")
    for k in (2, 3):
        ref = torch.load(src / f"ref-{k}.pt", weights_only=True)
        sd = run.at(k).state_dict()
        assert set(sd["model"]) == set(ref["model"])
        for name, t in ref["model"].items():
            assert _same(sd["model"][name], t), (k, name)
        groups = run.at(k).object("optim/param_groups")
        names = [n for g in groups for n in g["params"]]
        assert [g["params"] for g in groups] == [
            g["params"] for g in ref["optimizer"]["param_groups"]
        ]
        for i, name in enumerate(names):
            for key, v in ref["optimizer"]["state"][name].items():
                assert _same(sd["optimizer"]["state"][i][key], v), (k, name, key)
        assert sd["scheduler"]["last_epoch"] == k


def test_resume_from_an_imported_dcp_step_matches_dcp_load(
    multirank: dict[str, Path], tmp_path: Path
) -> None:
    import torch.distributed.checkpoint as dcp
    from ckpt_worker import Net, batch, groups
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def fresh(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = Net()
        return net, torch.optim.AdamW(groups(net), lr=1e-2)

    def train(net: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        x, y = batch(3, 0)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    def state(net: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
        out = [t.detach().numpy().tobytes() for t in net.state_dict().values()]
        return out + [
            v.numpy().tobytes() for st in opt.state_dict()["state"].values() for v in st.values()
        ]

    src = multirank["dcp1"] / "step-2"
    net, opt = fresh(5)  # DCP's own resume
    msd, osd = get_state_dict(net, opt)
    loaded = {"model": msd, "optimizer": osd}
    dcp.load(loaded, checkpoint_id=str(src))
    set_state_dict(net, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    train(net, opt)
    want = state(net, opt)
    import_checkpoints(src, tmp_path / "run")
    net, opt = fresh(6)
    with (
        pytest.warns(dstt.DsttWarning, match="no RNG state"),
        dstt.session(net, opt, run=tmp_path / "run", resume=True) as s,
    ):
        assert s.step == 2
        train(net, opt)
    assert state(net, opt) == want


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_tags_import_bit_exact(
    multirank: dict[str, Path], tmp_path: Path, world: int, stage: int
) -> None:
    src = multirank[f"ds{world}"]
    report = import_checkpoints(src / f"z{stage}", tmp_path / "run")
    assert [i.step for i in report.imported] == [2, 3]
    assert report.ok
    assert report.imported[0].lacks == ("scheduler state", "RNG state")
    run = dstt.open(tmp_path / "run")
    for k in (2, 3):
        ref = torch.load(src / f"ref-z{stage}-{k}.pt", weights_only=True)
        snap = run.at(k)
        for name, want in ref.items():
            assert _same(torch.from_numpy(snap.to_numpy(name)), want["fp32"]), (k, name)
            for key in ("exp_avg", "exp_avg_sq"):
                got = torch.from_numpy(snap.to_numpy(name, state=key))
                assert _same(got, want[key]), (k, name, key)
        sd = snap.state_dict()
        assert [g["weight_decay"] for g in sd["optimizer"]["param_groups"]] == [0.1, 0.0]
        assert all(float(st["step"]) == k for st in sd["optimizer"]["state"].values())
        extra = snap.object("extra/deepspeed")
        assert extra["zero_stage"] == stage
        assert extra["global_steps"] == k
        assert extra["dp_world_size"] == world


def test_a_deepspeed_tag_missing_a_rank_is_skipped(
    multirank: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "z2"
    shutil.copytree(multirank["ds2"] / "z2", src)
    (src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    report = import_checkpoints(src, tmp_path / "run")
    assert [i.step for i in report.imported] == [3]
    (bad,) = report.skipped
    assert bad.step == 2
    assert "complete" in bad.reason


@pytest.mark.parametrize("world", [1, 2])
def test_dcp_export_loads_into_any_world_size(
    multirank: dict[str, Path], tmp_path: Path, world: int
) -> None:
    from imports_setup import spawn

    src = multirank["dcp2"]
    import_checkpoints(src, tmp_path / "run")
    out = tmp_path / "export"
    info = dstt.open(tmp_path / "run").at(3).export(out, "dcp")
    assert info["path"] == str(out)
    assert (out / ".metadata").is_file()
    load = tmp_path / "load"
    load.mkdir()
    spawn("dcpload", world, load, [], str(out))
    got = torch.load(load / "loaded.pt", weights_only=True)
    ref = torch.load(src / "ref-3.pt", weights_only=True)
    for name, t in ref["model"].items():
        assert _same(got["model"][name], t), name
    for name, st in ref["optimizer"]["state"].items():
        for key, v in st.items():
            assert _same(got["optimizer"]["state"][name][key], v), (name, key)
