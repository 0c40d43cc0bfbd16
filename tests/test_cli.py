"""The ``dstt`` command line: every command in-process via ``main([...])``, and the installed
entry point once in a subprocess. Bad input must give one clear line and a non-zero code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dstt.cli import EXIT_BAD_INPUT, EXIT_OK, EXIT_PROBLEMS, EXIT_RUN, main
from dstt.store import Repository, save


def _arrays(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {
        "params/layers/0/attn/weight": rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16),
        "params/layers/1/mlp/weight": rng.standard_normal((5, 3)).astype(np.float32),
        "optim/exp_avg/layers/1/mlp/weight": rng.standard_normal((5, 3)).astype(np.float32),
    }


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "exp1"
    for s in (1, 2, 3, 4):
        save(path, s, _arrays(s), metrics={"loss": 1.0 / s})
    monkeypatch.delenv("DSTT_RUN", raising=False)
    monkeypatch.chdir(tmp_path)
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> object:
    code, out, err = _run(capsys, *argv, "--json")
    assert code == EXIT_OK, err
    return json.loads(out)


def test_ls_finds_the_run_by_argument_env_and_cwd(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, out, _ = _run(capsys, "ls", str(run_dir))
    assert code == EXIT_OK
    assert "4 steps (1 … 4)" in out
    assert "* main" in out
    doc = _json(capsys, "ls", "--run", str(run_dir))
    assert doc["n_steps"] == 4  # type: ignore[index]
    assert doc["n_arrays"] == 3  # type: ignore[index]
    monkeypatch.setenv("DSTT_RUN", str(run_dir))
    assert _json(capsys, "ls")["last_step"] == 4  # type: ignore[index]
    monkeypatch.delenv("DSTT_RUN")
    monkeypatch.chdir(run_dir)
    assert _json(capsys, "ls")["path"] == str(run_dir)  # type: ignore[index]


def test_log_lists_newest_first(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "--run", str(run_dir), "log")
    assert [c["step"] for c in doc] == [4, 3, 2, 1]  # type: ignore[union-attr,index]
    assert doc[0]["metrics"] == {"loss": 0.25}  # type: ignore[index]
    code, out, _ = _run(capsys, "log", "--run", str(run_dir), "-n", "2")
    assert code == EXIT_OK
    assert len(out.splitlines()) == 2
    assert "loss=0.25" in out


def test_show_lists_tensors_of_a_step(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "show", "--run", str(run_dir), "--step", "2")
    assert code == EXIT_OK
    assert "layers.0.attn.weight" in out
    assert "bfloat16" in out
    assert "exp_avg" not in out
    doc = _json(
        capsys, "show", "--run", str(run_dir), "--step", "2", "--optim", "--select", "layers.1"
    )
    names = [t["name"] for t in doc["tensors"]]  # type: ignore[index]
    assert names == ["optim/exp_avg/layers/1/mlp/weight", "layers.1.mlp.weight"]
    assert doc["step"] == 2  # type: ignore[index]
    assert doc["metrics"] == {"loss": 0.5}  # type: ignore[index]


def test_diff_prints_change_norms(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = _json(capsys, "diff", "1", "3", "--run", str(run_dir), "--top", "0")
    rows = {r["name"]: r for r in doc["tensors"]}  # type: ignore[index]
    a = _arrays(1)["params/layers/1/mlp/weight"].astype(np.float64)
    b = _arrays(3)["params/layers/1/mlp/weight"].astype(np.float64)
    assert rows["layers.1.mlp.weight"]["delta_l2"] == pytest.approx(np.linalg.norm(b - a))
    code, out, _ = _run(capsys, "diff", "1", "3", "--run", str(run_dir), "--top", "1")
    assert code == EXIT_OK
    assert "1 more" in out


def test_verify_ok_then_finds_a_damaged_chunk(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(capsys, "verify", "--run", str(run_dir))
    assert code == EXIT_OK
    assert out.startswith("ok: 4 commits")
    r = Repository.open(run_dir).reader()
    key = r.arrays(r.find(2))["params/layers/1/mlp/weight"].chunks[0].key
    f = run_dir / key
    data = bytearray(f.read_bytes())
    data[0] ^= 0xFF
    f.write_bytes(bytes(data))
    code, out, _ = _run(capsys, "verify", "--run", str(run_dir))
    assert code == EXIT_PROBLEMS
    assert f"PROBLEM {key}" in out
    assert "1 problem(s)" in out
    doc = json.loads(_run(capsys, "verify", "--run", str(run_dir), "--json")[1])
    assert doc["ok"] is False
    assert doc["problems"][0]["key"] == key


def test_rollback_then_gc(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(run_dir)  # "dstt rollback --to 2" must work as written from inside the run
    code, out, _ = _run(capsys, "rollback", "--to", "2", "--skip-data", "3")
    assert code == EXIT_OK
    assert "is current" in out
    ls = _json(capsys, "ls")
    assert ls["timeline"] != "main"  # type: ignore[index]
    assert ls["last_step"] == 2  # type: ignore[index]
    code, _, err = _run(capsys, "gc")
    assert code == EXIT_BAD_INPUT
    assert "retention policy" in err
    dry = _json(capsys, "gc", "--keep-last", "1", "--dry-run")
    assert dry["dry_run"] is True  # type: ignore[index]
    assert len(dry["pruned"]) == 2  # type: ignore[index,arg-type]
    doc = _json(capsys, "gc", "--keep-last", "1")
    assert sorted(p["step"] for p in doc["pruned"]) == [1, 3]  # type: ignore[index,union-attr]
    assert _json(capsys, "log", "--timeline", "main")[0]["step"] == 4  # type: ignore[index]


def test_export_writes_a_loadable_state_dict(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "s3.safetensors"
    code, text, _ = _run(capsys, "export", "--run", str(run_dir), "--step", "3", "-o", str(out))
    assert code == EXIT_OK
    assert "2 tensors" in text
    sd = load_file(out)
    np.testing.assert_array_equal(
        sd["layers.1.mlp.weight"].numpy(), _arrays(3)["params/layers/1/mlp/weight"]
    )
    assert sd["layers.0.attn.weight"].dtype == torch.bfloat16
    doc = _json(capsys, "export", "--run", str(run_dir), "--format", "torch", "--all")
    assert doc["tensors"] == 3  # type: ignore[index]
    assert doc["path"] == "step4.pt"  # type: ignore[index]
    full = torch.load("step4.pt", weights_only=True)  # {"model", "optimizer", "scheduler", ...}
    assert set(full["model"]) == {"layers.0.attn.weight", "layers.1.mlp.weight"}
    assert set(full["arrays"]) == {"optim/exp_avg/layers/1/mlp/weight"}  # --all: the rest


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["ls"], "no run given"),
        (["show", "--step", "99", "--run", "{run}"], "no committed step 99"),
        (["show", "--step", "two", "--run", "{run}"], "invalid int value"),
        (["log", "--timeline", "nope", "--run", "{run}"], "no timeline 'nope'"),
        (["diff", "1", "--run", "{run}"], "required: B"),
        (["rollback", "--to", "2", "--skip-data", "-1", "--run", "{run}"], "number >= 0"),
        (["frobnicate"], "invalid choice"),
        (["--run", "{missing}", "verify"], "no such directory"),
        (["ls", "{plain}"], "is not a dstt run"),
        (["show", "--run", "{run}", "--select", "decoder.*"], "matches no tensor"),
    ],
)
def test_bad_input_gives_one_line_and_code_2(
    run_dir: Path, tmp_path: Path, argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "plain").mkdir(exist_ok=True)
    subs = {
        "run": str(run_dir),
        "missing": str(tmp_path / "nope"),
        "plain": str(tmp_path / "plain"),
    }
    code, out, err = _run(capsys, *[a.format(**subs) for a in argv])
    assert code == EXIT_BAD_INPUT
    assert needle in err
    assert err.startswith("dstt: ")
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert out == ""


def test_locked_run_is_exit_3(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Repository.open(run_dir).writer():
        code, _, err = _run(capsys, "rollback", "--to", "2", "--run", str(run_dir))
    assert code == EXIT_RUN
    assert "locked" in err
    assert len(err.strip().splitlines()) == 1


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == EXIT_OK
    assert "exit codes" in out
    assert "rollback" in out


def test_installed_entry_point(run_dir: Path) -> None:
    exe = Path(sys.executable).parent / "dstt"
    assert exe.exists(), "install the package: pip install -e . (declares dstt = dstt.cli:main)"
    ok = subprocess.run(
        [str(exe), "ls", "--json", str(run_dir)], capture_output=True, text=True, check=False
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["n_steps"] == 4
    bad = subprocess.run(
        [str(exe), "show", "--step", "99", "--run", str(run_dir)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert bad.stdout == ""
    assert bad.stderr.startswith("dstt: no committed step 99")
    assert "Traceback" not in bad.stderr


def test_show_tells_what_each_tensor_cost_on_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dstt.store import DeltaPolicy

    run = tmp_path / "enc"
    repo = Repository.create(run)
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal((64, 32)).astype(np.float32)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    with repo.writer(encoding=DeltaPolicy(keyframe_every=4)) as wr:
        for step in (1, 2):
            txn = wr.begin(step)
            for path, a in (("params/frozen", frozen), ("params/w", w)):
                txn.declare(path, "float32", a.shape)
                txn.put_chunk(path, 0, a.reshape(-1).view(np.uint8))
            txn.commit()
            w = (w * np.float32(1.0001)).astype(np.float32)  # a small change: an XOR delta
    first = {
        t["name"]: t for t in _json(capsys, "show", "--run", str(run), "--step", "1")["tensors"]
    }  # type: ignore[index]
    assert first["w"]["stored_as"] == ["raw"]
    assert first["w"]["written_bytes"] > 8192
    doc = _json(capsys, "show", "--run", str(run), "--step", "2")
    t = {x["name"]: x for x in doc["tensors"]}  # type: ignore[index]
    assert t["frozen"]["stored_as"] == ["ref"]
    assert t["frozen"]["written_bytes"] == 0
    assert t["w"]["stored_as"] == ["xor"]
    assert 0 < t["w"]["written_bytes"] < t["w"]["bytes"]
    code, out, _ = _run(capsys, "show", "--run", str(run), "--step", "2")
    assert code == EXIT_OK
    assert "fewer bytes" in out
    assert " ref" in out


# -- issue 15: what a new user trips on ------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "code", "needle"),
    [
        (
            ["show", "{run}", "--select", "layers.0.atn"],
            EXIT_BAD_INPUT,
            "did you mean 'layers.0.attn'",
        ),
        (["diff", "{run}", "1", "3", "--select", "decoder"], EXIT_BAD_INPUT, "matches no tensor"),
        (["log", "{run}", "--spikes", "acc"], EXIT_BAD_INPUT, "'acc' was never logged"),
        (["ls", "{file}"], EXIT_BAD_INPUT, "is a file, not a run"),
        (["show", "3"], EXIT_BAD_INPUT, "for step 3, use --step 3"),
        (["ls", "{run}", "--run", "{plain}"], EXIT_BAD_INPUT, "two runs given"),
        (["gc", "{run}", "--keep-every", "0"], EXIT_BAD_INPUT, "number >= 1"),
        (["rollback", "{run}", "--to", "99"], EXIT_BAD_INPUT, "no committed step 99"),
        (["diff", "{run}", "1", "99"], EXIT_BAD_INPUT, "no committed step 99"),
        (["show", "{run}", "--timeline", "nope"], EXIT_BAD_INPUT, "no timeline 'nope'"),
        (["verify", "{plain}"], EXIT_BAD_INPUT, "not a dstt run"),
        (["log", "{zarr}"], EXIT_BAD_INPUT, "not a dstt run"),
    ],
)
def test_user_mistakes_print_their_message_never_internal_error(
    run_dir: Path,
    tmp_path: Path,
    argv: list[str],
    code: int,
    needle: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (tmp_path / "plain").mkdir(exist_ok=True)
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "z").mkdir(exist_ok=True)
    (tmp_path / "z" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    subs = {
        "run": str(run_dir),
        "plain": str(tmp_path / "plain"),
        "file": str(tmp_path / "notes.txt"),
        "zarr": str(tmp_path / "z"),
    }
    got, out, err = _run(capsys, *[a.format(**subs) for a in argv])
    assert (got, out) == (code, "")
    assert err.startswith("dstt: ")
    assert needle in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    assert "internal error" not in err
    assert not err.startswith(("dstt: '", 'dstt: "')), err  # no KeyError quoting


def test_a_bug_is_still_an_internal_error(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import dstt.cli.parser as cli

    def broken(args: object) -> int:
        return {}["a bug"]  # type: ignore[no-any-return]

    monkeypatch.setattr(cli, "cmd_ls", broken)
    code, _, err = _run(capsys, "ls", str(run_dir))
    assert code == cli.EXIT_INTERNAL
    assert "Traceback" in err
    assert "internal error" in err


def test_closed_pipe_exits_quietly(run_dir: Path) -> None:
    exe = Path(sys.executable).parent / "dstt"
    proc = subprocess.Popen(
        [str(exe), "log", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.close()  # the reader is gone before dstt writes a line (dstt log | true)
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert err == b""
    head = subprocess.run(
        f"'{exe}' log '{run_dir}' | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        check=False,
    )
    assert head.stdout.startswith("step        4")
    assert head.stderr == ""


def test_every_command_takes_the_run_positionally_and_finds_it_from_inside(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    inside = str(run_dir / "_dstt")
    for argv in (
        ["ls", inside],
        ["log", inside],
        ["show", inside],
        ["diff", inside, "1", "2"],
        ["verify", inside],
        ["gc", inside, "--keep-last", "9", "--dry-run"],
        [
            "export",
            inside,
            "--step",
            "2",
            "-o",
            str(run_dir.parent / "e" / "s2.pt"),
            "--format",
            "torch",
        ],
    ):
        code, out, err = _run(capsys, *argv)
        assert code in (EXIT_OK,), (argv, err)
        assert out, (argv, err)
        assert err == "", (argv, err)
    assert _json(capsys, "log", "--run", inside)[0]["step"] == 4  # type: ignore[index]
    assert _json(capsys, "diff", "1", "2", "--run", str(run_dir))["a"] == 1  # type: ignore[index]
    monkeypatch.setenv("DSTT_RUN", inside)
    assert _json(capsys, "show", "--step", "2")["step"] == 2  # type: ignore[index]
    monkeypatch.delenv("DSTT_RUN")
    monkeypatch.chdir(run_dir / "_dstt")
    code, out, _ = _run(capsys, "rollback", "--to", "3")
    assert code == EXIT_OK
    assert "is current" in out
    assert _json(capsys, "ls")["path"] == str(run_dir)  # type: ignore[index]


def test_show_prints_norms_and_update_ratios_from_summaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sums"
    rows = {"params/layers/1/mlp/weight": {"l2": 2.5, "update_l2": 0.025, "update_ratio": 0.01}}
    save(path, 1, _arrays(1), objects={"summaries": rows})
    doc = _json(capsys, "show", str(path))
    t = {x["name"]: x for x in doc["tensors"]}  # type: ignore[index]
    assert t["layers.1.mlp.weight"]["l2"] == 2.5
    assert t["layers.1.mlp.weight"]["update_ratio"] == 0.01
    assert t["layers.1.mlp.weight"]["update_exact"] is False  # an estimate, and says so
    assert t["layers.0.attn.weight"]["l2"] is None  # no summary for it: unknown, not 0
    code, out, _ = _run(capsys, "show", str(path))
    line = next(x for x in out.splitlines() if "layers.1.mlp.weight" in x)
    assert code == EXIT_OK
    assert "norm" in out
    assert " 2.5 " in line
    assert " ~0.01 " in line
    assert "~ update ratio" in out
    assert "estimate" in out


def test_log_marks_loss_spikes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "spiky"
    rng = np.random.default_rng(0)
    for s in range(1, 31):
        loss = 10.0 if s == 24 else 2.0 + 0.01 * float(rng.standard_normal())
        save(path, s, {"params/w": np.full(2, s, np.float32)}, metrics={"loss": loss})
    doc = _json(capsys, "log", str(path))
    marked = [c["step"] for c in doc if c["spike"]]  # type: ignore[union-attr,index]
    assert marked == [24]
    code, out, _ = _run(capsys, "log", str(path), "-n", "8")
    spiky = [x for x in out.splitlines() if "spike" in x]
    assert code == EXIT_OK
    assert len(spiky) == 1
    assert spiky[0].startswith("step       24")
    assert "loss spike (z=" in spiky[0]


def test_show_and_diff_agree_on_optimizer_states(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    optim = "optim/exp_avg/layers/1/mlp/weight"
    for extra, want in (([], False), (["--optim"], True)):
        shown = {t["name"] for t in _json(capsys, "show", str(run_dir), *extra)["tensors"]}  # type: ignore[index]
        diffed = {
            t["name"]
            for t in _json(capsys, "diff", str(run_dir), "1", "2", "--top", "0", *extra)["tensors"]
        }  # type: ignore[index]
        assert shown == diffed
        assert (optim in shown) is want


def _tree(path: Path) -> dict[str, tuple[int, bytes]]:
    """Every file's mtime and bytes; the lock file is left out (taking the lock records in it
    who holds it and since when: no run data)."""
    return {
        str(p.relative_to(path)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "lock"
    }


def test_gc_dry_run_lists_the_steps_and_changes_nothing(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _tree(run_dir)
    code, out, _ = _run(capsys, "gc", str(run_dir), "--keep-last", "2", "--dry-run")
    assert code == EXIT_OK
    assert "would prune step 1 of timeline main" in out
    assert "would prune step 2 of timeline main" in out
    assert "step 3" not in out
    assert "nothing was deleted" in out
    assert _tree(run_dir) == before
    assert _json(capsys, "log", str(run_dir))[-1]["step"] == 1  # type: ignore[index]


def _sharded(path: Path, step: int) -> None:
    """One commit by two writers the way ZeRO partitions a flat buffer (no DeepSpeed): the
    logical tensors a and b are views of zero/r0 and zero/r1 (as tests/inspect does)."""
    from dstt.store._internal import LogicalArray, Piece, shard_map
    from dstt.store.commit.parts import collect_parts

    repo = Repository.create(path)
    flat = np.arange(16, dtype=np.float32) + step
    writers = [repo.writer(), repo.writer(exclusive=False)]
    slot = writers[0].next_slot
    txns = []
    for r, w in enumerate(writers):
        t = w.begin(step, slot=slot)
        src = f"zero/r{r}/g0/fp32"
        t.declare(src, "float32", (8,))
        t.put_chunk(src, 0, flat[8 * r : 8 * r + 8].view(np.uint8))
        name = "params/a" if r == 0 else "params/b"
        t.put_object(
            f"shards/r{r}",
            shard_map([LogicalArray(name, "float32", (2, 4), (Piece(src, 0, 0, 8),))]),
        )
        txns.append(t)
    txns[1].prepare(rank=1, world=2, session="s")
    parts = collect_parts(repo.storage, slot=slot, step=step, ranks=[1], world=2, session="s")
    txns[0].commit({"loss": 1.0}, parts=parts)
    for w in writers:
        w.close()


def test_show_on_a_zero_run_counts_only_what_is_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zero"
    _sharded(path, 1)
    _sharded(path, 2)
    doc = _json(capsys, "show", str(path))
    t = {x["name"]: x for x in doc["tensors"]}  # type: ignore[index]
    assert t["a"]["stored"] is False
    assert t["a"]["bytes"] == 0
    assert t["a"]["stored_as"] == ["view"]
    stored = [x for x in t.values() if x["stored"]]
    assert sorted(x["name"] for x in stored) == ["zero/r0/g0/fp32", "zero/r1/g0/fp32"]
    assert sum(x["bytes"] for x in stored) == 64
    code, out, _ = _run(capsys, "show", str(path))
    last = next(x for x in out.splitlines() if "stored arrays" in x)
    assert code == EXIT_OK
    assert last.startswith("2 stored arrays, 64 B")
    assert "fewer bytes" not in out
    assert "2 tensors are views" in last
    ls = _json(capsys, "ls", str(path))
    # two logical tensors a user can name; the two flat shards are what is on disk
    assert ls["n_arrays"] == 2, ls  # type: ignore[index]
    assert ls["n_stored"] == 2, ls  # type: ignore[index]
    assert ls["bytes_per_step"] == 64  # type: ignore[index]


# -- timelines ---------------------------------------------------------------------------------


def test_timeline_list_switch_rename_delete(
    run_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(run_dir)
    assert _run(capsys, "rollback", "--to", "2")[0] == EXIT_OK
    rows = _json(capsys, "timeline", "list")
    assert [(t["name"], t["current"], t["head_step"]) for t in rows] == [  # type: ignore
        ("main", False, 4),
        ("main-from-2", True, 2),
    ]
    code, out, _ = _run(capsys, "timeline", "list")
    assert code == EXIT_OK
    assert "* main-from-2" in out
    assert "from main@2" in out

    code, out, _ = _run(capsys, "timeline", "switch", "main")
    assert code == EXIT_OK
    assert "'main' is now current" in out
    assert "step 4" in out
    assert _json(capsys, "ls")["timeline"] == "main"  # type: ignore[index]

    code, out, _ = _run(capsys, "timeline", "rename", "main-from-2", "retry")
    assert code == EXIT_OK
    assert "is now 'retry'" in out
    code, _, err = _run(capsys, "timeline", "rename", "retry", "main")
    assert code == EXIT_BAD_INPUT
    assert "already exists" in err

    code, _, err = _run(capsys, "timeline", "delete", "main", "--yes")
    assert code == EXIT_BAD_INPUT
    assert "current one" in err
    assert "timeline switch retry" in err
    code, _, err = _run(capsys, "timeline", "delete", "retry")
    assert code == EXIT_BAD_INPUT
    assert "--yes" in err
    assert "--dry-run" in err
    files = sorted(p.name for p in (run_dir / "steps").iterdir())
    assert _run(capsys, "timeline", "switch", "retry")[0] == EXIT_OK
    dry = _json(capsys, "timeline", "delete", "main", "--dry-run")
    assert dry["dry_run"] is True  # type: ignore[index]
    assert dry["freed_steps"] == [3, 4]  # type: ignore[index]
    assert sorted(p.name for p in (run_dir / "steps").iterdir()) == files  # nothing deleted
    code, out, _ = _run(capsys, "timeline", "delete", "main", "--yes")
    assert code == EXIT_OK
    assert "its own steps 3, 4" in out
    assert "stay: 1, 2" in out
    assert len(list((run_dir / "steps").iterdir())) == len(files) - 4
    rows = _json(capsys, "timeline", "list")
    assert [t["name"] for t in rows] == ["retry"]  # type: ignore[union-attr,index]
    assert _json(capsys, "show", "--step", "2")["step"] == 2  # type: ignore[index]
    assert _run(capsys, "verify")[0] == EXIT_OK


def test_rollback_to_the_same_step_twice_needs_a_name(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(capsys, "rollback", str(run_dir), "--to", "2")[0] == EXIT_OK
    code, _, err = _run(capsys, "rollback", str(run_dir), "--to", "2", "--timeline", "main")
    assert code == EXIT_BAD_INPUT
    assert "--name NAME" in err
    assert ".2" not in err
    doc = _json(
        capsys, "rollback", str(run_dir), "--to", "2", "--timeline", "main", "--name", "again"
    )
    assert doc["timeline"] == "again"  # type: ignore[index]
    assert doc["from_timeline"] == "main"  # type: ignore[index]
    assert _json(capsys, "ls", str(run_dir))["timeline"] == "again"  # type: ignore[index]


def test_diff_across_timelines_and_steps_on_other_timelines(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(capsys, "rollback", str(run_dir), "--to", "2")[0] == EXIT_OK
    save(run_dir, 3, _arrays(30), timeline="main-from-2")  # a different step 3
    doc = _json(
        capsys, "diff", str(run_dir), "3", "3", "--timeline", "main", "--timeline-b", "main-from-2"
    )
    assert (doc["timeline_a"], doc["timeline_b"]) == ("main", "main-from-2")  # type: ignore
    row = next(
        t
        for t in doc["tensors"]  # type: ignore[index,union-attr]
        if t["name"] == "layers.1.mlp.weight"
    )
    a, b = (_arrays(s)["params/layers/1/mlp/weight"] for s in (3, 30))
    assert row["delta_l2"] == pytest.approx(float(np.linalg.norm(b - a)), rel=1e-6)
    same = _json(capsys, "diff", str(run_dir), "3", "3", "--timeline", "main")
    assert all(t["delta_l2"] == 0 for t in same["tensors"])  # type: ignore[index,union-attr]
    code, out, _ = _run(capsys, "diff", str(run_dir), "2", "3", "--timeline-b", "main")
    assert code == EXIT_OK
    assert "B = step 3 of main" in out
    for argv in (["show", str(run_dir), "--step", "4"], ["diff", str(run_dir), "1", "4"]):
        code, _, err = _run(capsys, *argv)
        assert code == EXIT_BAD_INPUT, argv
        assert "step 4 is on timeline 'main'" in err, argv
        assert "--timeline main" in err


def test_rollback_skip_samples_and_timeline_list_shows_the_skip_set(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _run(
        capsys, "rollback", str(run_dir), "--to", "2", "--skip-samples", "25,285,868"
    )
    assert code == EXIT_OK
    assert "skip samples 25, 285, 868" in out
    import dstt

    run = dstt.open(run_dir)
    assert run.skips().samples == {25, 285, 868}  # as run.rollback(2, skip_samples=...) does
    rows = _json(capsys, "timeline", "list", str(run_dir))
    forked = next(r for r in rows if r["name"] == "main-from-2")  # type: ignore[union-attr]
    assert forked["skip_samples"] == [25, 285, 868]  # type: ignore[index]
    code, out, _ = _run(capsys, "timeline", "list", str(run_dir))
    line = next(x for x in out.splitlines() if "main-from-2" in x)
    assert "(skip samples 25, 285, 868)" in line
    assert "(skip 0)" not in out
    code, _, err = _run(capsys, "rollback", str(run_dir), "--to", "2", "--skip-samples", "3,x")
    assert code == EXIT_BAD_INPUT
    assert "'x'" in err


def test_ls_shows_the_metrics_of_the_newest_step_that_has_them(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save(run_dir, 5, _arrays(5))  # a head without metrics
    code, out, _ = _run(capsys, "ls", str(run_dir))
    assert code == EXIT_OK
    assert "metrics at step 4: loss=0.25" in out
    doc = _json(capsys, "ls", str(run_dir))
    assert doc["metrics_step"] == 4  # type: ignore[index]
    assert doc["metric_values"] == {"loss": 0.25}  # type: ignore[index]
    assert doc["metrics"] == ["loss"]  # type: ignore[index]


def test_run_diff_and_dstt_diff_leave_optimizer_states_out_by_default(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import dstt

    run = dstt.open(run_dir)
    for extra, optim in (([], False), (["--optim"], True)):
        cli = {
            t["name"]
            for t in _json(capsys, "diff", str(run_dir), "1", "2", "--top", "0", *extra)["tensors"]  # type: ignore[index]
        }
        py = {str(n) for n in run.diff(1, 2, optim=optim)["tensor"].values}
        assert {n.replace("/", ".") for n in cli} == {n.replace("/", ".") for n in py}
        assert any("exp_avg" in n for n in py) is optim
    assert "layers.1.mlp.weight" in {str(n) for n in run.diff(1, 2)["tensor"].values}


def test_retention_keep_last_zero_is_refused(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from dstt.store import Retention

    with pytest.raises(ValueError, match=r"keep_last=0\) would prune every step"):
        Retention(keep_last=0)
    assert Retention(keep_last=1).keep_last == 1
    code, _, err = _run(capsys, "gc", str(run_dir), "--keep-last", "0")
    assert code == EXIT_BAD_INPUT
    assert "keep_last >= 1" in err
    assert len(dstt_steps(run_dir)) == 4  # nothing pruned


def dstt_steps(path: Path) -> list[int]:
    import dstt

    return dstt.open(path).steps
