"""``DsttCheckpointEngine`` used the way the README shows it, in child processes (gloo, CPU).

The children attach, save two tags with a step between them and exit normally *without*
``close()``: the last tag must still be committed and ``latest`` must name it (the exit
flushes), and the run must read like a session's run: the model's own names, every tensor.
One child world of one rank and one of two ranks; ZeRO stages 0, 2 and 3.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt

from .conftest import PHASE_TIMEOUT, _clean_shm, _reports, _spawn, _wait

pytestmark = pytest.mark.timeout(900)

STAGES = (0, 2, 3)
WORLDS = (1, 2)


@pytest.fixture(scope="module")
def ckexit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    base = tmp_path_factory.mktemp("ckexit")
    ports: list[int] = []
    shm = Path("/dev/shm")
    before = {p.name for p in shm.iterdir()} if shm.is_dir() else set()
    results: dict[int, Any] = {}
    try:
        for world in WORLDS:
            root, out = base / f"w{world}", base / f"out{world}"
            root.mkdir()
            out.mkdir()
            res = results[world] = {"root": root}
            for phase in ("ckexit", "ckload"):
                procs = _spawn(phase, world, root, out, ports=ports, stages=STAGES)
                _wait(procs, PHASE_TIMEOUT)
                res[phase] = _reports(phase, world, out)
                res[f"{phase}_codes"] = [p.returncode for p in procs]
                res[f"{phase}_logs"] = [
                    (out / f"{phase}.r{r}.log").read_text(errors="replace") for r in range(world)
                ]
        yield results
    finally:
        with contextlib.suppress(OSError):
            _clean_shm(ports, before)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_last_save_survives_an_exit_without_close(
    ckexit: dict[int, Any], world: int, stage: int
) -> None:
    res = ckexit[world]
    assert res["ckexit_codes"] == [0] * world, res["ckexit_logs"]
    ckdir = res["root"] / f"z{stage}"
    assert (ckdir / "latest").read_text() == "t2"
    assert dstt.open(ckdir / "dstt").steps == [1, 2]
    for rank in range(world):  # a fresh engine loads t2 (``latest``) bit for bit
        saved, loaded = res["ckexit"][rank], res["ckload"][rank]
        assert "error" not in saved, saved["error"]
        assert "error" not in loaded, loaded["error"]
        got = loaded[str(stage)]
        assert "/t2/" in got["path"]
        assert got["global_steps"] == 2
        assert got["params"] == saved[str(stage)]["params"]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", STAGES)
def test_checkpoint_run_has_model_names(ckexit: dict[int, Any], world: int, stage: int) -> None:
    res = ckexit[world]
    snap = dstt.open(res["root"] / f"z{stage}" / "dstt").at(1)  # t1
    names = snap.names()
    for n in ("l1.weight", "l1.bias", "l2.bias", "norm.weight", "norm.bias"):
        assert n in names, names  # biases (5 and 13 elements) included
    want = res["ckexit"][0][str(stage)]["params1"]
    tree = snap.layer("l1")["l1"].to_dataset()
    for var in ("weight", "bias"):  # the fp32 master weights, bit for bit
        assert tree[var].values.reshape(-1).tolist() == want[f"l1.{var}"]
    st = snap.tensor("l2.weight", state="exp_avg").values
    assert st.shape == (5, 13)
    assert torch.isfinite(torch.from_numpy(st)).all()


def test_a_save_that_raised_is_dropped(ckexit: dict[int, Any]) -> None:
    res = ckexit[1]
    assert res["ckexit"][0]["raised"] == "SchemaError"
    ckdir = res["root"] / "raised"
    assert (ckdir / "latest").read_text() == "t3"  # committed by the exit
    run = dstt.open(ckdir / "dstt")
    assert run.steps == [1, 3]  # t2 (step 2) never committed
    assert "dstt: checkpoint 't2' was not committed" in res["ckexit_logs"][0]
