"""dstt under PyTorch-native parallelism: real gloo ranks on the CPU (see ``conftest.py``).

Every kind (DDP, FSDP2, tensor parallel on 2 ranks; FSDP2 x tensor parallel on a 2 x 2 mesh):
the same ``dstt.session(...)`` on every rank; the logical tensors of a step equal the full
state gathered with ``get_state_dict(full_state_dict=True)``, bit for bit; a resume on the same
ranks continues bit-exactly (losses and state equal an uninterrupted run); one plain process
reads and resumes the run (2 → 1) and the ranks resume what it wrote (1 → 2); a SIGKILL of one
rank mid-flush leaves the last commit intact and resumable; ranks that disagree, or a session
on rank 0 only, get a typed error on every rank, never a hang.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import dstt
from dstt.store import Repository

from .conftest import CRASH_KINDS, KINDS

pytestmark = pytest.mark.timeout(1200)

MESHES = [(kind, "") for kind in KINDS] + [("fsdp_tp", "4")]
NAMES = [
    "scale",
    "down.bias",
    "down.weight",
    "embed.bias",
    "embed.weight",
    "head.bias",
    "head.weight",
    "norm.bias",
    "norm.weight",
    "up.bias",
    "up.weight",
]


def _ok(results: dict[str, Any], tag: str) -> list[dict[str, Any]]:
    got = results[tag]
    for rank, r in enumerate(got):
        assert r["ok"], f"{tag} rank {rank}: {r.get('error')}\n{r.get('trace', '')}"
    return got


@pytest.mark.parametrize(("kind", "world"), MESHES)
def test_every_rank_runs_one_session_and_resumes_bit_exactly(
    rank_results: dict[str, Any], kind: str, world: str
) -> None:
    for rank, r in enumerate(_ok(rank_results, f"train{world}")):
        k = r[kind]
        assert k["session"] == "DistributedSession"
        assert k["first_losses_equal"], rank  # capturing changes nothing
        assert k["resumed_at"] == 3
        assert k["restored_diff"] == [], (rank, k["restored_diff"])
        assert k["lr_after_resume"] == [0.005]  # the scheduler's step after step 3
        assert k["losses"] == k["ref_losses"], rank  # float equality: bit-exact
        assert k["final_diff"] == [], (rank, k["final_diff"])
        # run.at(k).load_into(model, optimizer) into the sharded model, on every rank
        assert k["load_into_diff"] == [], (rank, k["load_into_diff"])
        assert k["load_into_lr"] == [0.005]


@pytest.mark.parametrize(("kind", "world"), MESHES)
def test_one_process_sees_logical_tensors_and_resumes_them(
    rank_results: dict[str, Any], kind: str, world: str
) -> None:
    r = _ok(rank_results, f"single{world}")[0][kind]
    assert r["steps"] == [1, 2, 3, 4, 5, 6]
    assert r["logical_diff"] == []  # params, buffers, optimizer state: bit for bit
    assert r["names"] == NAMES  # the model's own names: no module./_fsdp prefix, no shards
    # summaries: one row per logical tensor (the ranks' shards folded), at every step, with
    # the statistics of the whole tensor
    assert r["summary_tensors"] == [n for n in NAMES if n != "scale"]
    assert r["summary_steps"] == [1, 2, 3, 4, 5, 6]
    assert r["summary_max_rel_err"] < 1e-6
    assert r["up_dims"] == ["out_features", "in_features"]  # the module's dims, as stored
    assert r["session"] == "Session"  # a plain model in a plain process
    assert r["resumed_at"] == 6
    assert r["restored_diff"] == []
    assert r["steps_after"] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert r["verify_ok"]


@pytest.mark.parametrize(("kind", "world"), MESHES)
def test_ranks_resume_what_one_process_wrote(
    rank_results: dict[str, Any], kind: str, world: str
) -> None:
    got = _ok(rank_results, f"grow{world}")
    for rank, r in enumerate(got):
        assert r[kind]["resumed_at"] == 8
        assert r[kind]["restored_diff"] == [], (rank, r[kind]["restored_diff"])
    assert got[0][kind]["steps_after"] == list(range(1, 10))  # rank 0 returns once committed


@pytest.mark.parametrize("kind", KINDS)
def test_each_rank_writes_only_its_share(rank_results: dict[str, Any], kind: str) -> None:
    """Every byte once: the stored arrays add up to the logical tensors (no copy per rank,
    no gathered copy), and both ranks write part of them."""
    reader = Repository.open(rank_results["root"] / kind).reader()
    header = reader.find(3)
    table = reader.arrays(header)
    per_rank = [0, 0]
    for rec in table.values():
        for c in rec.chunks:
            per_rank[1 if ".r00001." in c.key else 0] += c.nbytes - 4  # minus crc32c trailer
    shards = [p for p in table if p.startswith("dtensor/")]
    logical = [p for p in table if not p.startswith("dtensor/")]
    if kind == "ddp":
        assert not shards  # replicated: each tensor whole, written by one rank
    else:
        assert shards
        assert all(p.startswith(("dtensor/w2/r0/", "dtensor/w2/r1/")) for p in shards)
    sizes = {p: rec.plan.itemsize * _numel(rec.shape) for p, rec in table.items()}
    # the shard sources tile their logical tensors: no element is stored twice
    from dstt.store._internal import logical_arrays

    assembled = logical_arrays(reader, header, table)
    assert all(p not in assembled for p in logical)
    assert sum(per_rank) == sum(sizes.values())
    assert sum(sizes[p] for p in shards) == sum(a.numel * 4 for a in assembled.values())  # float32
    assert min(per_rank) > 0.25 * sum(per_rank), per_rank  # the bytes are spread


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.parametrize("kind", CRASH_KINDS)
def test_a_rank_killed_mid_flush_leaves_a_resumable_run(
    rank_results: dict[str, Any], kind: str
) -> None:
    crash = rank_results[f"crash-{kind}"]
    assert crash["committed_before_kill"] >= 3  # the kill came after commits, not before
    run = rank_results["root"] / f"crash-{kind}"
    assert Repository.open(run).verify().ok
    for rank, r in enumerate(_ok(rank_results, f"after-{kind}")):
        assert r["resumed_at"] == r["head"] >= 3
        assert r["restored_diff"] == [], (rank, r["restored_diff"])
        assert r["losses_equal"], rank


def test_ranks_that_disagree_get_a_typed_error_on_every_rank(rank_results: dict[str, Any]) -> None:
    for r in _ok(rank_results, "misuse"):
        assert r["disagree"].startswith("RankError: ")
        assert "every (rank 0: 1, rank 1: 2)" in r["disagree"]
        assert r["two_runs"].startswith("RankError: ")
        assert "disagree on run" in r["two_runs"]


def test_a_session_on_rank_0_only_is_a_typed_error_not_a_hang(rank_results: dict[str, Any]) -> None:
    r = _ok(rank_results, "misuse")[0]
    assert r["subset"].startswith("RankError: ")
    assert "ranks [1] did not send" in r["subset"]
    assert r["subset_s"] < 30


def test_the_distributed_example_runs_as_documented(tmp_path: Path) -> None:
    """docs/distributed.md's example, launched with torchrun on 2 CPU ranks."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            str(root / "examples" / "distributed.py"),
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "[DistributedSession, 2 ranks] resumed at step 10" in proc.stdout
    assert "steps: 1..15" in proc.stdout
    assert dstt.open(tmp_path / "run").steps == list(range(1, 16))
