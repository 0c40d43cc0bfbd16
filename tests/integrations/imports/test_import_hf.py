"""Hugging Face Trainer folders imported into a run (real Trainer checkpoints, tiny GPT-2).

Proves: each ``checkpoint-N`` becomes step N with every tensor bit-exact (weights, optimizer
state named and grouped as the Trainer built it, scheduler, RNG); ``log_history`` becomes the
run's metrics, every step; every view works on the imported run; re-importing a folder that
gained checkpoints imports only the new ones; a truncated checkpoint is reported and skipped
with nothing half-committed; and — the flagship — ``DsttCallback(resume=True)`` from an
imported step (after ``dstt rollback``) continues bit-exactly as the Trainer's own
``resume_from_checkpoint`` does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import dstt
from dstt.integrations.imports import import_checkpoints
from dstt.schema import IMPORT_OBJECT
from dstt.store import Repository


@pytest.fixture(scope="module")
def imported(hf_checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("hfrun") / "run"
    report = import_checkpoints(hf_checkpoints, run)
    assert report.ok
    assert [i.step for i in report.imported] == [2, 4, 6]
    assert all(i.lacks == () for i in report.imported)  # a Trainer checkpoint holds it all
    return run


def _load(path: Path) -> Any:
    with torch.serialization.safe_globals(
        [
            np._core.multiarray._reconstruct,
            np.ndarray,
            np.dtype,  # the Trainer's own list
            type(np.dtype(np.uint32)),
        ]
    ):
        return torch.load(path, weights_only=True)


def test_every_checkpoint_is_its_step_bit_exact(hf_checkpoints: Path, imported: Path) -> None:
    from safetensors.torch import load_file

    run = dstt.open(imported)
    assert run.steps == [2, 4, 6]
    for k in (2, 4, 6):
        src = hf_checkpoints / f"checkpoint-{k}"
        snap = run.at(k)
        sd = snap.state_dict()
        weights = load_file(src / "model.safetensors")
        # HF's safetensors drop the tied head; the state dict names it, as
        # model.state_dict() does, with the embedding's values
        assert set(sd["model"]) - set(weights) == {"lm_head.weight"}
        assert set(weights) <= set(sd["model"])
        assert torch.equal(sd["model"]["lm_head.weight"], weights["transformer.wte.weight"])
        for name, t in weights.items():
            assert torch.equal(sd["model"][name], t), name
        # the optimizer: the Trainer's two groups (decay / no decay), numbered as it numbers
        osd = torch.load(src / "optimizer.pt", weights_only=True)
        got = sd["optimizer"]
        assert [len(g["params"]) for g in got["param_groups"]] == [
            len(g["params"]) for g in osd["param_groups"]
        ]
        for g_got, g_src in zip(got["param_groups"], osd["param_groups"], strict=True):
            assert {h: v for h, v in g_got.items() if h != "params"} == {
                h: v for h, v in g_src.items() if h != "params"
            }
        assert set(got["state"]) == set(osd["state"])
        for i, st in osd["state"].items():
            for key, v in st.items():
                assert torch.equal(got["state"][i][key], v), (i, key)
        assert sd["scheduler"] == torch.load(src / "scheduler.pt", weights_only=True)
        rng = _load(src / "rng_state.pth")
        stored = snap.object("rng")
        assert stored["torch"] == rng["cpu"].numpy().tobytes()
        assert tuple(stored["python"][1]) == rng["python"][1]
        np.testing.assert_array_equal(stored["numpy"][1], rng["numpy"][1])
        origin = snap.object(IMPORT_OBJECT)
        assert origin["path"] == str(src)
        assert origin["format"] == "hf-trainer"
    # the names the optimizer state was stored under are the model's
    decay_group = run.at(4).object("optim/param_groups")[0]["params"]
    assert "transformer.h.0.attn.c_attn.weight" in decay_group
    assert not any(n.endswith("bias") or ".ln_" in n for n in decay_group)


def test_log_history_is_the_runs_metrics(hf_checkpoints: Path, imported: Path) -> None:
    state = json.loads((hf_checkpoints / "checkpoint-6" / "trainer_state.json").read_text())
    want = {e["step"]: e["loss"] for e in state["log_history"] if "loss" in e}
    assert sorted(want) == [1, 2, 3, 4, 5, 6]
    got = dstt.open(imported).metrics()
    assert {
        int(s): float(v) for s, v in zip(got["step"].values, got["loss"].values, strict=True)
    } == want
    heads = Repository.open(imported).reader().lineage()
    assert [h.metrics["loss"] for h in heads] == [want[2], want[4], want[6]]


def test_every_view_works_on_an_imported_run(imported: Path, tmp_path: Path) -> None:
    run = dstt.open(imported)
    tree = run.at(4).layer("transformer.h.0.attn")
    assert tree["transformer/h/0/attn/c_attn"]["weight"].shape == (32, 96)
    traj = run.trajectory("transformer.h.0.attn.c_attn.weight")
    assert list(traj["step"].values) == [2, 4, 6]
    summ = run.summaries()
    assert list(summ["step"].values) == [2, 4, 6]
    assert np.isfinite(summ["l2"].values).all()
    # the update from the previous imported step, estimated from the probes (as the engine)
    assert np.isnan(summ["update_l2"].sel(step=2).values).all()
    assert (summ["update_l2"].sel(step=[4, 6]).values > 0).all()
    assert isinstance(run.spikes(), list)
    d = run.diff(2, 6)
    assert len(d) > 0
    out = run.at(6).export(tmp_path / "six.safetensors")
    assert out["tensors"] == len(run.at(6).names())
    assert run.verify().problems == []
    from dstt.widgets import scrubber

    w = scrubber(run)
    assert w is not None


def test_resume_from_an_imported_step_matches_the_trainers_own_resume(
    imported: Path, hf_reference: dict[str, Any], tmp_path: Path
) -> None:
    """The flagship: rollback to 4 in the imported run, then the Trainer resumes from it
    through ``DsttCallback`` — the same losses and the same final state, bit for bit, as
    ``resume_from_checkpoint="checkpoint-4"``."""
    from hf_setup import Recorder, state_hash
    from imports_setup import hf_trainer

    from dstt.integrations.transformers import DsttCallback

    run = tmp_path / "run"
    shutil.copytree(imported, run)
    dstt.open(run).rollback(to=4)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = Recorder()
        cb = DsttCallback(run=run, resume=True)
        tr = hf_trainer(tmp_path / "out", [rec, cb], save_strategy="no")
        tr.train(resume_from_checkpoint=cb.resume_from())
    finally:
        torch.set_num_threads(n)
    assert rec.start == 4
    assert rec.losses == hf_reference["losses"]  # steps 5 and 6, exactly
    assert state_hash(tr.model, tr.optimizer.optimizer) == hf_reference["hash"]
    assert dstt.open(run).steps == [2, 4, 5, 6]  # the resumed steps captured on the new line


def test_reimport_imports_only_new_checkpoints(hf_checkpoints: Path, tmp_path: Path) -> None:
    src = tmp_path / "out"
    src.mkdir()
    for k in (2, 4):
        shutil.copytree(hf_checkpoints / f"checkpoint-{k}", src / f"checkpoint-{k}")
    run = tmp_path / "run"
    first = import_checkpoints(src, run)
    assert [i.step for i in first.imported] == [2, 4]
    shutil.copytree(hf_checkpoints / "checkpoint-6", src / "checkpoint-6")  # training went on
    again = import_checkpoints(src, run)
    assert [i.step for i in again.imported] == [6]
    assert [(s.step, s.reason, s.problem) for s in again.skipped] == [
        (2, "already imported", False),
        (4, "already imported", False),
    ]
    assert again.ok
    assert dstt.open(run).steps == [2, 4, 6]
    # steps between 4 and 6 came with step 6's history, once
    m = dstt.open(run).metrics()
    assert list(m["step"].values) == [1, 2, 3, 4, 5, 6]


def test_a_truncated_checkpoint_is_reported_and_skipped(
    hf_checkpoints: Path, tmp_path: Path
) -> None:
    src = tmp_path / "out"
    shutil.copytree(hf_checkpoints, src)
    weights = src / "checkpoint-4" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # a job killed while saving
    run = tmp_path / "run"
    report = import_checkpoints(src, run)
    assert [i.step for i in report.imported] == [2, 6]
    (bad,) = report.skipped
    assert bad.problem
    assert bad.step == 4
    assert "model.safetensors" in bad.reason
    assert not report.ok
    r = dstt.open(run)
    assert r.steps == [2, 6]
    assert r.verify().problems == []
    assert len(Repository.open(run).reader().lineage()) == 2  # nothing half-committed
