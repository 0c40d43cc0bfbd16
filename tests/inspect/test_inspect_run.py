"""Run and Snapshot: steps, timelines, rollback, gc, diff, export, HTML repr, errors."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from inspect_helpers import new_repo, small_model, write_steps

from dstt.errors import CurrentTimelineError, NotARunError, StepNotFoundError, TimelineError
from dstt.run import open_run


def test_steps_timelines_and_head(small_run: Path) -> None:
    run = open_run(small_run)
    assert run.steps == [1, 2, 3, 4, 5]
    assert run.timeline == "main"
    assert set(run.timelines) == {"main"}
    assert run.at().step == 5
    snap = run.at(2)
    assert snap.metrics == {"loss": pytest.approx(1 / 3)}
    assert "layers.0.attn.q_proj.weight" in snap.names()
    assert not any(n.startswith("optim/") for n in snap.names())
    assert "optim/exp_avg/layers/0/attn/q_proj/weight" in snap.names(optim=True)
    np.testing.assert_array_equal(snap.to_numpy("emb.weight"), small_model(2)["params/emb/weight"])
    np.testing.assert_array_equal(
        snap.to_numpy("layers.0.attn.q_proj.weight", state="exp_avg"),
        small_model(2)["optim/exp_avg/layers/0/attn/q_proj/weight"],
    )


def test_bad_inputs_raise_clear_errors(small_run: Path, tmp_path: Path) -> None:
    run = open_run(small_run)
    with pytest.raises(StepNotFoundError, match="no committed step 99"):
        run.at(99)
    with pytest.raises(TimelineError, match="no timeline 'nope'"):
        run.at(1, timeline="nope")
    with pytest.raises(KeyError, match="no tensor named 'missing'"):
        run.at(1).tensor("missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NotARunError):
        open_run(tmp_path / "empty")


def test_rollback_creates_a_current_timeline_and_keeps_the_old(small_run: Path) -> None:
    run = open_run(small_run)
    name = run.rollback(to=3, skip_data=2)
    assert run.timeline == name != "main"
    assert run.steps == [1, 2, 3]
    assert run.timelines[name].skip_data == 2
    assert run.timelines[name].base_step == 3
    assert [h.step for h in run.commits("main")] == [1, 2, 3, 4, 5]
    assert run.at(5, timeline="main").step == 5
    with pytest.raises(StepNotFoundError):
        run.at(5)
    again = open_run(small_run)
    assert again.timeline == name  # durable, seen by a fresh reader


def test_gc_prunes_outside_policy_and_never_a_head(small_run: Path) -> None:
    run = open_run(small_run)
    assert run.steps == [1, 2, 3, 4, 5]  # headers now cached; gc must still be seen
    side = run.rollback(to=2)
    assert [h.step for h in run.commits("main")] == [1, 2, 3, 4, 5]
    report = run.gc(keep_last=1, keep_every=100)
    # keep_last=1 per timeline keeps each head (2 and 5) only
    assert {s for _, s in report.pruned_steps} == {1, 3, 4}
    # the old head survives; step 2 too: it is the new head, shared by both lineages
    assert [h.step for h in run.commits("main")] == [2, 5]
    assert run.steps == [2]
    assert run.timeline == side
    with pytest.raises(StepNotFoundError, match="pruned"):
        run.at(3, timeline="main")
    assert run.verify().ok


def test_diff_matches_numpy(small_run: Path) -> None:
    ds = open_run(small_run).diff(1, 4)
    a, b = small_model(1), small_model(4)
    row = ds.sel(tensor="layers.1.mlp.weight")
    d = b["params/layers/1/mlp/weight"].astype(np.float64) - a["params/layers/1/mlp/weight"]
    assert float(row["delta_l2"]) == pytest.approx(np.linalg.norm(d), rel=1e-12)
    assert float(row["max_abs_delta"]) == pytest.approx(np.abs(d).max())
    assert float(row["ratio"]) == pytest.approx(
        np.linalg.norm(d) / np.linalg.norm(a["params/layers/1/mlp/weight"].astype(np.float64))
    )
    assert set(ds["status"].values) == {"both"}
    only = open_run(small_run).diff(1, 4, selector="layers.1")
    assert sorted(only["tensor"].values) == ["layers.1.attn.q_proj.weight", "layers.1.mlp.weight"]


def test_diff_reports_tensors_on_one_side(tmp_path: Path) -> None:
    repo = new_repo(tmp_path / "run")
    write_steps(repo, [1], lambda s: {"params/a": np.ones(3, np.float32)})
    write_steps(
        repo,
        [2],
        lambda s: {"params/a": np.ones(3, np.float32), "params/b": np.ones(2, np.float32)},
    )
    ds = open_run(tmp_path / "run").diff(1, 2)
    assert dict(zip(ds["tensor"].values, ds["status"].values, strict=True)) == {
        "a": "both",
        "b": "only_b",
    }
    assert float(ds.sel(tensor="a")["delta_l2"]) == 0.0
    assert np.isnan(float(ds.sel(tensor="b")["delta_l2"]))


def test_export_safetensors_and_torch_are_bit_exact(small_run: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    snap = open_run(small_run).at(4)
    info = snap.export(tmp_path / "s.safetensors", "safetensors")
    sd = load_file(tmp_path / "s.safetensors")
    expect = small_model(4)
    assert info["tensors"] == len(sd) == 7  # model tensors only, optimizer state left out
    w = sd["layers.0.attn.q_proj.weight"]
    assert w.dtype == torch.bfloat16
    np.testing.assert_array_equal(
        w.view(torch.uint16).numpy(), expect["params/layers/0/attn/q_proj/weight"].view(np.uint16)
    )
    assert sd["scale"].shape == ()
    assert float(sd["scale"]) == 4.0
    assert sd["layers.0.mask"].dtype == torch.bool
    snap.export(tmp_path / "s.pt", "torch", include_all=True)
    full = torch.load(tmp_path / "s.pt", weights_only=True)
    assert full["optimizer"] is None  # written by the store alone: no torch optimizer objects
    assert torch.equal(full["model"]["layers.0.attn.q_proj.weight"], w)
    np.testing.assert_array_equal(
        full["arrays"]["optim/exp_avg/layers/0/attn/q_proj/weight"].numpy(),
        expect["optim/exp_avg/layers/0/attn/q_proj/weight"],
    )
    with pytest.raises(ValueError, match="unknown export format"):
        snap.export(tmp_path / "x", "onnx")


def test_html_repr_is_static_and_escaped(tmp_path: Path) -> None:
    path = tmp_path / "<b>run"
    write_steps(new_repo(path), [7, 8], lambda s: {"params/w": np.zeros(4, ml_dtypes.bfloat16)})
    run = open_run(path)
    html = run._repr_html_()
    assert "&lt;b&gt;run" in html
    assert "<b>run" not in html
    assert "main" in html
    assert "7 … 8" in html
    assert "<script" not in html
    s = run.summary()
    assert (s["n_steps"], s["n_arrays"], s["bytes_per_step"]) == (2, 1, 8)
    assert "steps=2 [7..8]" in repr(run)


def test_refresh_sees_new_steps(small_run: Path) -> None:
    run = open_run(small_run)
    write_steps(new_repo(small_run), [6], small_model)
    assert run.steps[-1] == 5  # read as of open
    assert run.refresh().steps[-1] == 6


def test_refresh_sees_gc_by_another_process(small_run: Path) -> None:
    run = open_run(small_run)
    assert run.steps == [1, 2, 3, 4, 5]
    open_run(small_run).gc(keep_last=2)
    assert run.refresh().steps == [4, 5]


# -- timeline management ---------------------------------------------------------------------


def test_a_second_rollback_to_the_same_step_needs_a_name(small_run: Path) -> None:
    run = open_run(small_run)
    first = run.rollback(to=3)
    assert first == "main-from-3"
    with pytest.raises(TimelineError, match=r"rolled back to before.*name=") as ei:
        run.rollback(to=3, timeline="main")  # no silent "main-from-3.2"
    assert "dstt rollback --to 3 --name NAME" in str(ei.value)
    assert set(run.timelines) == {"main", first}
    assert run.timeline == first
    second = run.rollback(to=3, timeline="main", name="retry", skip_data=1)
    assert run.timeline == second == "retry"
    assert run.timelines["retry"].skip_data == 1
    with pytest.raises(TimelineError, match="'retry' already exists"):
        run.rollback(to=2, name="retry")


def test_a_step_on_another_timeline_says_which(small_run: Path) -> None:
    run = open_run(small_run)
    run.rollback(to=3)
    for call in (lambda: run.at(5), lambda: run.diff(1, 5)):
        with pytest.raises(StepNotFoundError, match="no committed step 5") as ei:
            call()
        assert "step 5 is on timeline 'main': pass timeline='main'" in str(ei.value)
        assert "--timeline main" in str(ei.value)
    with pytest.raises(StepNotFoundError) as ei:
        run.at(99)
    assert "is on timeline" not in str(ei.value)  # nowhere: no hint
    assert run.at(5, timeline="main").step == 5


def test_switch_rename_and_delete_timelines(small_run: Path) -> None:
    run = open_run(small_run)
    side = run.rollback(to=2)
    snap = run.at(2)
    assert snap.timeline == side
    assert snap.header.timeline == "main"  # read from / written on
    run.switch("main")
    assert run.timeline == "main"
    assert run.steps == [1, 2, 3, 4, 5]
    assert open_run(small_run).timeline == "main"  # durable
    with pytest.raises(TimelineError, match="no timeline 'nope'"):
        run.switch("nope")

    run.rename_timeline(side, "side")
    assert set(run.timelines) == {"main", "side"}
    assert run.timeline == "main"
    assert [h.step for h in run.commits("side")] == [1, 2]
    run.rename_timeline("main", "trunk")  # the current one: HEAD follows, the child too
    assert run.timeline == "trunk"
    assert run.timelines["side"].base_timeline == "trunk"

    with pytest.raises(CurrentTimelineError, match="switch") as ei:
        run.delete_timeline("trunk")
    assert isinstance(ei.value, TimelineError)
    want = {s: run.at(s).to_numpy("emb.weight", native=True) for s in (1, 2)}
    run.switch("side")
    dry = run.delete_timeline("trunk", dry_run=True)
    assert set(run.timelines) == {"trunk", "side"}
    assert dry.freed_steps == (3, 4, 5)
    rep = run.delete_timeline("trunk")
    assert (rep.freed_steps, rep.kept_steps) == ((3, 4, 5), (1, 2))
    assert rep.gc.files_removed == dry.gc.files_removed > 0
    assert set(run.timelines) == {"side"}
    assert run.steps == [1, 2]
    for s, a in want.items():  # the shared steps stay, bit-exactly
        assert run.at(s).to_numpy("emb.weight", native=True).tobytes() == a.tobytes()
    assert run.verify().ok
    steps_dir = small_run / "steps"
    assert {int(n.name[:12]) for n in steps_dir.iterdir()} == {h.slot for h in run.commits()}
