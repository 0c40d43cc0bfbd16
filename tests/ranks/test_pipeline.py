"""Pipeline parallelism (``torch.distributed.pipelining``, 2 real gloo stages, an optimizer
and a scheduler per stage): each stage's optimizer structure is stored per rank, resume on
the same layout is bit-exact, another layout is refused at session start, and one plain
process sees every stage's tensors under their own names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt

from .conftest import launch, logs_of, wait

WORKER = Path(__file__).with_name("pipeline_worker.py")


def phase(name: str, run: Path, out: Path) -> list[dict[str, Any]]:
    wait(launch(WORKER, [name, str(run), str(out)], 2, out, name), timeout=180)
    res = []
    for r in range(2):
        report = out / f"{name}.r{r}.json"
        assert report.exists(), f"{name} rank {r} wrote no report:\n{logs_of(out, name)}"
        res.append(json.loads(report.read_text()))
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
