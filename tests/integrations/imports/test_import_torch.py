"""``torch.save`` files (and a safetensors file) imported into a run.

The files come from a real training loop: a model with tied weights and BatchNorm buffers,
AdamW and a LambdaLR, ``torch.save({"model", "optimizer", "scheduler", "step"})`` every two
steps. Proves: bit-exact tensors and optimizer state named by the state dict's own order
(tied weights once, buffers apart); resume through ``dstt.session(resume=True)`` from an
imported step continues exactly as ``torch.load`` + ``load_state_dict`` does, and warns that
the file held no RNG state; a pickle that needs more than ``weights_only`` is refused with a
message naming ``--trusted`` (and imported with it); a step whose write fails half-way is
aborted, never half-committed; ``model=`` names what the order cannot (frozen parameters);
``DeltaPolicy`` shrinks a series whose frozen tensors repeat; the CLI's output and exit codes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.cli import main
from dstt.errors import DsttWarning, SchemaError
from dstt.integrations.imports import import_checkpoints


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.bn = torch.nn.BatchNorm1d(6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.bn(self.emb(x).mean(1)))))


class Meta:  # a class torch.load(weights_only=True) refuses to build
    def __init__(self) -> None:
        self.note = "made by hand"


def _parts(seed: int = 0, frozen: bool = False) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = Tied()
    if frozen:
        model.emb.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    return model, opt, sched


def _step(model: Any, opt: Any, sched: Any, k: int) -> None:
    g = torch.Generator().manual_seed(k)
    x, y = torch.randint(0, 11, (8, 3), generator=g), torch.randint(0, 11, (8,), generator=g)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def _train(out: Path, steps: int = 6, frozen: bool = False) -> None:
    out.mkdir(parents=True)
    model, opt, sched = _parts(frozen=frozen)
    for k in range(1, steps + 1):
        _step(model, opt, sched, k)
        if k % 2 == 0:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(),
                    "step": k,
                },
                out / f"step_{k:05d}.pt",
            )


def _state(model: Any, opt: Any) -> list[bytes]:
    out = [t.detach().numpy().tobytes() for t in model.state_dict().values()]
    for st in opt.state_dict()["state"].values():
        out += [v.numpy().tobytes() for v in st.values()]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("torch") / "ckpts"
    _train(out)
    return out


def test_files_are_imported_bit_exact(files: Path, tmp_path: Path) -> None:
    report = import_checkpoints(files, tmp_path / "run")
    assert [i.step for i in report.imported] == [2, 4, 6]
    assert report.imported[0].lacks == ("RNG state",)
    run = dstt.open(tmp_path / "run")
    for k in (2, 4, 6):
        src = torch.load(files / f"step_{k:05d}.pt", weights_only=True)
        snap = run.at(k)
        sd = snap.state_dict()
        for name, t in src["model"].items():
            if name != "head.weight":  # tied: stored once, under emb.weight
                assert torch.equal(sd["model"][name], t), name
        assert snap.object("names/tied") == {"head.weight": "emb.weight"}
        assert "buffers.bn.running_mean" not in sd["model"]
        assert "bn.num_batches_tracked" in [n for n in snap.names()]
        for i, st in src["optimizer"]["state"].items():
            for key, v in st.items():
                assert torch.equal(sd["optimizer"]["state"][i][key], v)
        assert sd["optimizer"]["param_groups"] == src["optimizer"]["param_groups"]
        assert sd["scheduler"] == src["scheduler"]


def test_resume_from_an_imported_file_matches_torch_load(files: Path, tmp_path: Path) -> None:
    # torch's own resume: load step 4's file, train steps 5 and 6
    model, opt, sched = _parts(seed=1)
    src = torch.load(files / "step_00004.pt", weights_only=True)
    model.load_state_dict(src["model"])
    opt.load_state_dict(src["optimizer"])
    sched.load_state_dict(src["scheduler"])
    for k in (5, 6):
        _step(model, opt, sched, k)
    want = _state(model, opt)
    # dstt: import, roll back to 4, resume
    run = tmp_path / "run"
    import_checkpoints(files, run)
    dstt.open(run).rollback(to=4)
    model, opt, sched = _parts(seed=2)
    with (
        pytest.warns(DsttWarning, match=r"holds no RNG state"),
        dstt.session(model, opt, run=run, scheduler=sched, resume=True) as s,
    ):
        assert s.step == 4
        for k in (5, 6):
            _step(model, opt, sched, k)
    assert _state(model, opt) == want
    assert dstt.open(run).steps == [2, 4, 5, 6]


def test_resume_without_optimizer_state_says_what_the_source_lacked(tmp_path: Path) -> None:
    model, opt, _ = _parts()
    torch.save(model.state_dict(), tmp_path / "step_3.pt")  # weights only
    import_checkpoints(tmp_path / "step_3.pt", tmp_path / "run")
    want = r"imported from .*step_3\.pt \(torch\), which holds no optimizer state.*load_into"
    with (
        pytest.raises(SchemaError, match=want),
        dstt.session(model, opt, run=tmp_path / "run", resume=True),
    ):
        pass
    snap = dstt.open(tmp_path / "run").at(3)  # what it says to do works
    fresh, _, _ = _parts(seed=3)
    snap.load_into(fresh)
    assert torch.equal(fresh.mid.weight, model.mid.weight)


def test_a_pickle_that_needs_unpickling_is_refused_unless_trusted(tmp_path: Path) -> None:
    model, _, _ = _parts()
    torch.save({"model": model.state_dict(), "meta": Meta()}, tmp_path / "step_7.pt")
    report = import_checkpoints(tmp_path / "step_7.pt", tmp_path / "run")
    (bad,) = report.skipped
    assert "--trusted" in bad.reason
    assert "Meta" in bad.reason
    assert not report.imported
    trusted = import_checkpoints(tmp_path / "step_7.pt", tmp_path / "run", trusted=True)
    assert [i.step for i in trusted.imported] == [7]


def test_a_step_that_fails_while_written_is_never_half_committed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    good = {"a": torch.arange(6.0), "b": torch.ones(3)}
    torch.save(good, src / "step_1.pt")
    # "a" is written before "z" is refused (dstt stores no complex tensors)
    torch.save(
        {"a": torch.arange(6.0) + 1, "z": torch.zeros(2, dtype=torch.complex64)}, src / "step_2.pt"
    )
    torch.save({k: v + 2 for k, v in good.items()}, src / "step_3.pt")
    report = import_checkpoints(src, tmp_path / "run")
    assert [i.step for i in report.imported] == [1, 3]
    assert [s.step for s in report.skipped] == [2]
    assert "complex" in report.skipped[0].reason
    run = dstt.open(tmp_path / "run")
    assert run.steps == [1, 3]
    assert run.verify().problems == []


def test_model_names_frozen_parameters_and_delta_policy_shrinks(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _train(src, steps=8, frozen=True)
    # the optimizer holds 4 parameters, the state dict 5: the order alone cannot name them
    plain = import_checkpoints(src, tmp_path / "plain")
    assert not plain.imported
    assert "pass model=" in plain.skipped[0].reason
    model, _, _ = _parts(frozen=True)
    raw = import_checkpoints(src, tmp_path / "raw", model=model)
    delta = import_checkpoints(src, tmp_path / "delta", model=model, encoding=dstt.DeltaPolicy())
    assert [i.step for i in raw.imported] == [i.step for i in delta.imported] == [2, 4, 6, 8]

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    assert size(tmp_path / "delta") < size(tmp_path / "raw")  # the frozen embedding once
    a, b = dstt.open(tmp_path / "raw"), dstt.open(tmp_path / "delta")
    for k in a.steps:
        for name in a.at(k).names(optim=True):
            assert a.at(k).to_numpy(name).tobytes() == b.at(k).to_numpy(name).tobytes()
    assert b.verify().problems == []


def test_a_safetensors_file_with_a_step(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(4.0), "n": torch.tensor([3])}, tmp_path / "model.safetensors")
    report = import_checkpoints(tmp_path / "model.safetensors", tmp_path / "run", step=12)
    assert [i.step for i in report.imported] == [12]
    snap = dstt.open(tmp_path / "run").at(12)
    assert snap.names() == ["n", "w"]  # "n" (an int tensor) is a buffer
    assert snap.to_numpy("w").tolist() == [0.0, 1.0, 2.0, 3.0]


def test_cli_import(files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    assert main(["import", str(files), "--run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "imported step        2  torch" in out
    assert "3 imported into" in out
    assert main(["import", str(files), "--run", str(run), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["imported"] == []
    assert [s["reason"] for s in doc["skipped"]] == ["already imported"] * 3
    # a broken source: reported, the others imported, exit 1
    bad = tmp_path / "more"
    shutil.copytree(files, bad)
    (bad / "step_00008.pt").write_bytes(b"not a checkpoint")
    assert main(["import", str(bad), "--run", str(run)]) == 1
    captured = capsys.readouterr().out
    assert "skipped step 8" in captured
    assert "step_00008.pt" in captured
    # bad input: exit 2, one line on stderr
    os.environ.pop("DSTT_RUN", None)
    here = os.getcwd()
    os.chdir(tmp_path)  # not inside a run
    try:
        assert main(["import", str(files)]) == 2
    finally:
        os.chdir(here)
    assert "--run PATH" in capsys.readouterr().err
    os.chdir(run / "steps")  # inside the run: it is found, as every command finds it
    try:
        assert main(["import", str(files)]) == 0
    finally:
        os.chdir(here)
    assert "already imported" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "nothing"), "--run", str(run)]) == 2
    assert main(["import", str(files), "--run", str(run), "--step", "3"]) == 2


def test_cli_import_needs_no_transformers(files: Path, tmp_path: Path) -> None:
    """``dstt import`` of torch files must not need the transformers extra: a child in which
    ``import transformers`` fails (a sitecustomize shim) imports them, exit 0."""
    import subprocess
    import sys

    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    env = dict(os.environ)
    root = Path(dstt.__file__).parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(root)])
    probe = [sys.executable, "-c", "import transformers"]
    assert subprocess.run(probe, env=env, capture_output=True).returncode != 0  # really gone
    run = tmp_path / "run"
    got = subprocess.run(
        [sys.executable, "-m", "dstt.cli", "import", str(files), "--run", str(run)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0, got.stderr
    assert "3 imported into" in got.stdout
    assert dstt.open(run).steps == [2, 4, 6]
