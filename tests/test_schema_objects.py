"""A step's object names have one owner, ``dstt.schema``: every name dstt writes is declared
there (a session of one process and of two spawned gloo ranks, an import), no module of
``dstt/`` spells a declared name as a literal, and the declared list only grows."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt import schema
from dstt.integrations.imports import import_checkpoints
from dstt.store import Repository

ROOT = Path(__file__).resolve().parents[1]

#: OBJECT_NAMES as first released: names are appended, never renamed, reordered or dropped
RELEASED = (
    "summaries",
    "names/tied",
    "model/config",
    "optim/state",
    "optim/param_groups",
    "scheduler",
    "rng",
    "data",
    "data/batches",
    "metrics/history",
    "import/source",
    "parallel/layout",
    "deepspeed/engine",
    "deepspeed/meta",
    "shards",
    "zero/scalars",
    "extra",
    "files",
)

#: literals equal to a declared name that are not object names, by the word and the modules
#: where it means something else
NOT_OBJECT_NAMES: dict[str, frozenset[str]] = {
    # a torch checkpoint's / state_dict's / trainer's "scheduler" key, a keyword's name
    "scheduler": frozenset(
        {
            "dstt/cli/replay.py",
            "dstt/inspect/export_dcp.py",
            "dstt/inspect/replay_kit.py",
            "dstt/inspect/restore.py",
            "dstt/integrations/_common.py",
            "dstt/integrations/imports/from_dcp.py",
            "dstt/integrations/imports/from_torch.py",
            "dstt/training/deepspeed.py",
        }
    ),
    # tagged JSON's and a tensor dict's "data" field; a spike's suspect
    "data": frozenset(
        {
            "dstt/engine/tensors/_convert.py",
            "dstt/inspect/diagnose.py",
            "dstt/store/format/objects.py",
        }
    ),
    # the arrays table's, an index segment's and an import source's or export's file list
    "files": frozenset(
        {
            "dstt/inspect/export.py",
            "dstt/integrations/imports/write.py",
            "dstt/store/format/manifest.py",
            "dstt/store/format/segment.py",
            "dstt/store/index/rows.py",
            "dstt/store/index/view.py",
            "dstt/store/read/reader.py",
        }
    ),
    # a series' source ("summaries" or "tensors"), a session option, a function in __all__
    "summaries": frozenset(
        {"dstt/plots/series.py", "dstt/run/views.py", "dstt/training/options.py"}
    ),
}


def test_declared_names_only_grow() -> None:
    """Append-only: the released names keep their place; new ones come after them."""
    assert schema.OBJECT_NAMES[: len(RELEASED)] == RELEASED
    assert len(set(schema.OBJECT_NAMES)) == len(schema.OBJECT_NAMES)
    assert all(isinstance(n, str) and n and not n.endswith("/") for n in schema.OBJECT_NAMES)
    assert set(schema.__all__) >= {n for n in dir(schema) if n.endswith("_OBJECT")}


def test_declared_object_accepts_children_only_of_declared_names() -> None:
    assert schema.declared_object("rng/r3")
    assert schema.declared_object("optim/state/0")
    assert schema.declared_object("extra/lightning/hparams")
    assert schema.declared_object("summaries")
    assert not schema.declared_object("rngs")
    assert not schema.declared_object("optim")  # a parent is not a name
    assert not schema.declared_object("_stage")


def test_no_module_spells_a_declared_object_name() -> None:
    """A literal equal to a declared name anywhere in dstt/ outside dstt/schema.py fails,
    unless it is listed above as meaning something else there."""
    declared = set(schema.OBJECT_NAMES)
    found = []
    for path in sorted((ROOT / "dstt").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "dstt/schema.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value in declared
                and rel not in NOT_OBJECT_NAMES.get(node.value, frozenset())
            ):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    assert found == [], "use the dstt.schema constant:\n" + "\n".join(found)
    # the exemptions are still needed (a stale one would hide a real use later)
    for word, modules in NOT_OBJECT_NAMES.items():
        for rel in modules:
            tree = ast.parse((ROOT / rel).read_text(), rel)
            assert any(isinstance(n, ast.Constant) and n.value == word for n in ast.walk(tree)), (
                f"{rel} no longer spells {word!r}: drop it from NOT_OBJECT_NAMES"
            )


def _written(run: Path) -> set[str]:
    r = Repository.open(run).reader()
    return {name for tl in r.timelines for h in r.lineage(tl) if not h.pruned for name in h.objects}


def _undeclared(names: set[str]) -> list[str]:
    return sorted(n for n in names if not schema.declared_object(n))


class _Counter:
    """An ``extra_state`` object: anything with ``state_dict``/``load_state_dict``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.n = d["n"]


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x).mean(1))))


def _batches() -> Any:
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randint(0, 11, (24, 3), generator=g), torch.randint(0, 11, (24,), generator=g)
    ds = torch.utils.data.TensorDataset(xs, ys)
    return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, generator=g)


def test_a_session_writes_only_declared_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    counter = _Counter()
    with dstt.session(
        model, opt, run=tmp_path / "run", scheduler=sched, extra_state={"c": counter}, every=2
    ) as s:
        for x, y in s.data(_batches()):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            counter.n += 1
            s.log(loss=loss.item())
    names = _written(tmp_path / "run")
    for must in (
        schema.SUMMARIES_OBJECT,
        schema.TIED_OBJECT,
        schema.OPTIM_STATE_OBJECT,
        schema.SCHEDULER_OBJECT,
        schema.RNG_OBJECT,
        schema.DATA_OBJECT,
        schema.BATCHES_OBJECT,
        schema.METRICS_HISTORY_OBJECT,
        f"{schema.EXTRA_OBJECT}/c",
    ):
        assert must in names, (must, sorted(names))
    assert _undeclared(names) == []


def test_an_import_writes_only_declared_names(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    (tmp_path / "ckpts").mkdir()
    for k in (2, 4):
        x = torch.randint(0, 11, (8, 3))
        torch.nn.functional.cross_entropy(model(x), torch.randint(0, 11, (8,))).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict(),
                "step": k,
            },
            tmp_path / "ckpts" / f"step_{k:05d}.pt",
        )
    import_checkpoints(tmp_path / "ckpts", tmp_path / "run")
    names = _written(tmp_path / "run")
    assert schema.IMPORT_OBJECT in names
    assert schema.OPTIM_STATE_OBJECT in names
    assert _undeclared(names) == []


_RANK_CHILD = """
import os, sys
import torch, torch.distributed as dist
import dstt
from torch.nn.parallel import DistributedDataParallel as DDP
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
g = torch.Generator().manual_seed(rank)
with dstt.session(model, opt, run=sys.argv[1], scheduler=sched, rank_timeout=120) as s:
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        s.log(loss=loss.item())
dist.destroy_process_group()
print("ok")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_ranks_write_only_declared_names(tmp_path: Path) -> None:
    """Two spawned gloo ranks (DDP) commit together: every rank's objects are declared."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(_RANK_CHILD), str(tmp_path / "run")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
        assert out.strip().endswith("ok")
    names = _written(tmp_path / "run")
    assert {f"{schema.RNG_OBJECT}/r0", f"{schema.RNG_OBJECT}/r1"} <= names, sorted(names)
    assert _undeclared(names) == [], json.dumps(sorted(names))


@pytest.mark.parametrize("name", ["_stage", "rngs", "optimizer"])
def test_an_undeclared_name_is_reported(name: str) -> None:
    """The check above can fail: names outside the schema are listed."""
    assert _undeclared({name, schema.RNG_OBJECT}) == [name]
