"""Pipeline parallelism (``torch.distributed.pipelining``, 2 real gloo stages, an optimizer
and a scheduler per stage): each stage's optimizer structure is stored per rank, resume on
the same layout is bit-exact, another layout is refused at session start, and one plain
process sees every stage's tensors under their own names."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt

from .conftest import free_port

WORKER = Path(__file__).with_name("pipeline_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def phase(name: str, run: Path, out: Path) -> list[dict[str, Any]]:
    port, procs = free_port(), []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), name, str(run), str(out)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        for p in procs:
            p.wait(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    res = [json.loads((out / f"{name}.r{r}.json").read_text()) for r in range(2)]
    for r, x in enumerate(res):
        assert x["ok"], f"{name} rank {r}: {x.get('trace')}"
    return res


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("pipeline")
    run = out / "run"
    got = {"run": run}
    for name in ("ref", "first", "resume", "relayout"):
        got[name] = phase(name, run, out)
    return got


def test_each_stage_resumes_bit_exactly(pipeline: dict[str, Any]) -> None:
    ref, resumed = pipeline["ref"], pipeline["resume"]
    for rank in range(2):
        assert "error" not in resumed[rank], resumed[rank]["error"]
        assert resumed[rank]["resumed_at"] == 6
        assert resumed[rank]["tensors"] == ref[rank]["tensors"], f"stage {rank} differs"
    # the last stage computes the loss: steps 7 and 8 after the resume are the reference's
    assert resumed[1]["losses"] == ref[1]["losses"][6:]


def test_each_stage_stores_its_own_optimizer_structure(pipeline: dict[str, Any]) -> None:
    run = dstt.open(pipeline["run"])
    head = run.reader.head()
    assert head is not None
    names = set(head.objects)
    for rank in range(2):
        assert f"optim/state/r{rank}" in names
        assert f"optim/param_groups/r{rank}" in names
        assert f"scheduler/r{rank}" in names or any(
            n.startswith("scheduler") and n.endswith(f"/r{rank}") for n in names
        ), sorted(names)
    assert "parallel/layout" in names


def test_another_layout_is_refused_at_session_start(pipeline: dict[str, Any]) -> None:
    for rank, res in enumerate(pipeline["relayout"]):
        assert res.get("error", "").startswith("SchemaError: "), (rank, res)
        assert "same pipeline layout" in res["error"]
    assert dstt.open(pipeline["run"]).steps[-1] == 8  # nothing was committed by the refusal


def test_one_process_sees_every_stage_under_its_own_names(pipeline: dict[str, Any]) -> None:
    snap = dstt.open(pipeline["run"]).at(8)
    ref = {**pipeline["ref"][0]["tensors"], **pipeline["ref"][1]["tensors"]}
    for i in range(4):
        for kind in ("weight", "bias"):
            name = f"layers.{i}.{kind}"
            got = np.asarray(snap.tensor(name).values, dtype=np.float32).ravel()
            assert got.tolist() == np.asarray(ref[name], dtype=np.float32).tolist(), name


def test_a_plain_process_does_not_resume_a_pipeline_as_one_model(
    pipeline: dict[str, Any],
) -> None:
    """Its optimizer state is split by stage: a one-process resume is refused, not silently
    started with empty state."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"layers": torch.nn.ModuleDict({str(i): torch.nn.Linear(8, 8) for i in range(4)})}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    session = dstt.session(model, opt, run=pipeline["run"], resume=True)
    with pytest.raises(dstt.SchemaError, match="pipeline of 2 stages"), session:
        pass
