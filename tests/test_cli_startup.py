"""Commands that print no arrays start fast: they import no xarray, pandas, torch, zarr or
matplotlib.

``dstt ls`` used to take 1.5 s (xarray and pandas imported by ``dstt.run``) against 0.08 s
for ``--help``, and a first ``run.metrics()`` 2 s (issue 37). Timing a start-up is noisy on a
shared machine, so this checks what it costs: the modules each command leaves in
``sys.modules``, in a fresh interpreter (the timings: ``bench/firstcontact_bench.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dstt.store import Repository, save

HEAVY = ("xarray", "pandas", "torch", "matplotlib", "scipy", "zarr", "numcodecs")
#: not heavy, but nothing an index-only command (ls, log, show, open().steps, metrics())
#: uses: the crc32c package's __init__ reads its version through importlib.metadata, and
#: the store loads only its C extension (dstt.store.format.envelope)
LIGHT = ("crc32c", "importlib.metadata")
CODE = f"""
import json, sys
from dstt.cli import main
code = main(sys.argv[1:])
print(json.dumps({{"code": code, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
print(json.dumps([m for m in {LIGHT!r} if m in sys.modules]))
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("startup") / "run"
    for step in (1, 2, 3):
        save(
            path,
            step,
            {"params/l1/weight": np.full((4, 2), step, np.float32)},
            metrics={"acc": 0.5},
        )
    return path


@pytest.mark.parametrize(
    "argv",
    [
        ["ls"],
        ["ls", "--json"],
        ["verify"],
        ["index"],
        ["timeline", "list"],
        ["rollback", "--to", "2"],
        ["gc", "--keep-last", "2", "--dry-run"],
    ],
)
def test_listing_commands_import_no_array_library(run_dir: Path, argv: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE, *argv, str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-2])
    assert got == {"code": 0, "heavy": []}, (argv, got)
    if argv[0] == "ls":
        assert json.loads(out.stdout.splitlines()[-1]) == [], argv


SUMMARY_FIELDS = ("l2", "rms", "maxabs", "nan", "inf", "update_l2", "update_ratio")


@pytest.fixture(scope="module")
def spiky_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 commits with write-time summaries (a ``summaries`` object, as a session writes) and
    a loss spike at step 30 whose cause update moved one tensor 50x its baseline: ``dstt log``
    explains the spike from the summaries, ``dstt show`` prints a step's."""
    path = tmp_path_factory.mktemp("spiky") / "run"
    rng = np.random.default_rng(0)
    paths = [f"params/layers/{i}/weight" for i in range(4)]
    with Repository.create(path).writer() as w:
        for step in range(40):
            txn = w.begin(step)
            for p in paths:
                txn.declare(p, "float32", (2, 2))
                txn.put_chunk(p, 0, np.full(4, step, np.float32).view(np.uint8))
            cols: dict[str, object] = {"columns": 1, "path": paths}
            for f in SUMMARY_FIELDS:
                cols[f] = 1.0 + 0.01 * rng.random(len(paths))
            if step == 29:  # the cause of the spike at 30: layers.2 moved 50x its usual
                cols["update_ratio"] = np.array([1.0, 1.0, 50.0, 1.0])
            cols["probe"] = rng.standard_normal((len(paths), 16))
            cols["probe_len"] = np.full(len(paths), 16)
            txn.put_object("summaries", cols)
            loss = 2.0 + 0.01 * rng.standard_normal() + (5.0 if step == 30 else 0.0)
            txn.commit({"loss": float(loss)})
    return path


@pytest.mark.parametrize(
    "argv",
    [["log"], ["log", "-n", "20", "--json"], ["show", "--step", "29"], ["show", "--step", "3"]],
)
def test_log_and_show_import_no_array_library(spiky_run: Path, argv: list[str]) -> None:
    """``dstt log`` ranks the spike's tensors and ``dstt show`` prints a step's summaries from
    the index's numpy columns: neither imports xarray (nor torch, through ``dstt.engine``)."""
    out = subprocess.run(
        [sys.executable, "-c", CODE, *argv, str(spiky_run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.splitlines()[-2])
    assert got == {"code": 0, "heavy": []}, (argv, got)
    assert json.loads(out.stdout.splitlines()[-1]) == [], argv
    if argv == ["log"]:  # the spike was found and explained (the summaries were read)
        assert "loss spike" in out.stdout
        assert "suspect update" in out.stdout
    if argv[:2] == ["show", "--step"]:
        assert "layers.2" in out.stdout


def test_spike_ranking_from_columns_matches_the_dataset(spiky_run: Path) -> None:
    """The numpy columns rank a step's update as the ``summaries()`` Dataset does."""
    import dstt
    from dstt.inspect.diagnose import rank_by_baseline
    from dstt.inspect.indexed import summary_columns

    run = dstt.open(spiky_run)
    cols = summary_columns(run.reader.scalar_rows(run.commits()))
    ds = run.summaries()
    assert cols.sizes == {"step": 40, "tensor": 4}
    for name in ("l2", "update_ratio", "update_exact", "probe"):
        np.testing.assert_array_equal(cols[name].values, ds[name].values)
    assert cols["tensor"].values.tolist() == ds["tensor"].values.tolist()
    ranked = rank_by_baseline(cols, 29)
    assert ranked == rank_by_baseline(ds, 29)
    assert ranked[0][0] == "layers.2.weight"
    (spike,) = run.spikes("loss", top=3)
    assert spike.cause == 29
    assert spike.suspect == "update"
    assert spike.tensors[0][0] == "layers.2.weight"


API = {
    "import": "import dstt",
    "version": "import dstt; dstt.__version__",
    "steps": "import dstt; dstt.open(RUN).steps",
    "metrics": "import dstt; m = dstt.open(RUN).metrics(); m.column('acc'); 'acc' in m; m.names",
    "spikes": "import dstt; dstt.open(RUN).spikes('acc')",
    "store": "import dstt.store; dstt.store.Repository.open(RUN).reader().lineage('main')",
}


@pytest.mark.parametrize("what", sorted(API))
def test_open_steps_and_metrics_import_no_heavy_module(run_dir: Path, what: str) -> None:
    code = (
        f"import json, sys\nRUN = {str(run_dir)!r}\n{API[what]}\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
        f"print(json.dumps([m for m in {LIGHT!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-2]) == [], what
    if what != "version":  # dstt.__version__ asks importlib.metadata
        assert json.loads(out.stdout.splitlines()[-1]) == [], what


def test_import_dstt_loads_no_numpy_and_no_metadata(run_dir: Path) -> None:
    """``import dstt`` alone: the error classes and the lazy names, nothing else."""
    code = (
        "import json, sys\nimport dstt\n"
        "print(json.dumps([m for m in ('numpy', 'importlib.metadata', 'dstt.store', "
        "'dstt.run') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_metrics_dataset_is_built_when_asked(run_dir: Path) -> None:
    """What is not numpy (``m["acc"]``, ``.sel``) builds the Dataset — and says the same."""
    import dstt

    m = dstt.open(run_dir).metrics("main")  # "main": the rollback test above moved HEAD
    assert m.names == ["acc"]
    assert "acc" in m
    assert "step" in m
    assert "nope" not in m
    assert m.steps.tolist() == [1, 2, 3]
    assert m.column("acc").tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(KeyError, match="never logged; logged: \\['acc'\\]"):
        m.column("nope")
    assert m["acc"].sel(step=2).item() == 0.5
    assert m.to_xarray()["step"].values.tolist() == [1, 2, 3]
    assert list(m.data_vars) == ["acc"]


def test_light_steps_are_found_from_the_index_bytes(tmp_path: Path) -> None:
    """``dstt log`` finds every="auto"'s light records by searching the index's header bytes
    (no header parsed per step): every commit carrying one is found, indexed or not, and
    none without one is read."""
    import dstt
    from dstt.engine.capture.light import LIGHT_OBJECT

    path = tmp_path / "run"
    carriers = {5: [3, 4], 9: [8], 12: [10, 11]}
    repo = Repository.create(path)
    with repo.writer() as w:
        for step in (*range(0, 3), 5, 6, 7, 9):
            txn = w.begin(step)
            txn.declare("params/w", "float32", (2,))
            txn.put_chunk("params/w", 0, np.zeros(2, np.float32).view(np.uint8))
            if step in carriers:
                txn.put_object(LIGHT_OBJECT, {"steps": carriers[step], "loss": [None] * 9})
            # steps 0-2 have the name in a metric's text: their bytes match too
            txn.commit({"loss": 1.0, **({"note": "light/steps"} if step < 3 else {})})
    repo.reindex()  # as `dstt index`: every commit so far is a row of the index
    run = dstt.open(path)
    assert {int(h.slot) for h in run.commits()} == set(run.reader.index.rows)
    assert run.reader.index.slots_mentioning(b'"light/steps"')  # read from the index
    with repo.writer() as w:  # a tail commit the index may not have yet
        txn = w.begin(12)
        txn.put_object(LIGHT_OBJECT, {"steps": carriers[12], "loss": [None, None]})
        txn.commit({"loss": 1.0})
    run = dstt.open(path)
    line = run.commits()
    got = run.reader.carrying(line, LIGHT_OBJECT)
    assert {h.step for h in got} >= set(carriers)
    # 0-2: the metric's text matches the bytes (a harmless superset: read_light checks each
    # one's objects); 6 and 7 are not read at all
    assert {h.step for h in got} == {*carriers, 0, 1, 2}
    assert sorted(run.light_steps()) == [3, 4, 8, 10, 11]


#: what ``dstt ls`` and ``dstt.open(run).steps`` may load beyond a bare interpreter: the
#: standard library, numpy (the index's columns are numpy arrays: ~0.1 s of the 0.3 s budget,
#: docs/performance.md "First contact") and the dstt modules below — the store's read path,
#: the run's facade and its parts, the names of a commit, the CLI's command modules. Not the
#: spike rules, the views' builders, the codecs, the engine, the write path: a new import on
#: these paths fails here by name.
READ_PATH = {
    "dstt",
    "dstt._lazy",
    "dstt._lru",
    "dstt.cli",
    "dstt.cli.changes",
    "dstt.cli.common",
    "dstt.cli.explain",
    "dstt.cli.imports",
    "dstt.cli.inspect",
    "dstt.cli.parser",
    "dstt.cli.rebuild",
    "dstt.cli.replay",
    "dstt.cli.virtual",
    "dstt.errors",
    "dstt.inspect",
    "dstt.inspect.catalog",
    "dstt.inspect.html",
    "dstt.inspect.naming",
    "dstt.inspect.readers",
    "dstt.inspect.selection",
    "dstt.inspect.sharded",
    "dstt.run",
    "dstt.run.lines",
    "dstt.run.metrics",
    "dstt.run.opening",
    "dstt.run.rebuilt",
    "dstt.run.run",
    "dstt.run.snapshot",
    "dstt.run.views",
    "dstt.schema",
    "dstt.store",
    "dstt.store._internal",
    "dstt.store.format",
    "dstt.store.format.envelope",
    "dstt.store.format.layout",
    "dstt.store.format.manifest",
    "dstt.store.format.objects",
    "dstt.store.format.records",
    "dstt.store.format.segment",
    "dstt.store.format.zarr_meta",
    "dstt.store.index",
    "dstt.store.index.rows",
    "dstt.store.index.shard_summaries",
    "dstt.store.index.source",
    "dstt.store.index.view",
    "dstt.store.read",
    "dstt.store.read.chunks",
    "dstt.store.read.reader",
    "dstt.store.read.shards",
    "dstt.store.repository",
    "dstt.store.storage",
    "dstt.store.storage.base",
    "dstt.store.storage.local",
    "dstt.store.storage.local_blob",
    "dstt.store.storage.posix",
    "dstt.store.storage.urls",
}
PINNED_CODE = """
import json, sys
before = set(sys.modules)
{stmt}
print(json.dumps(sorted(set(sys.modules) - before)))
"""
PINNED = {
    "ls": "from dstt.cli import main\nassert main(['ls', RUN]) == 0",
    "steps": "import dstt\nassert dstt.open(RUN).steps",
}


@pytest.mark.parametrize("what", sorted(PINNED))
def test_ls_and_steps_load_only_the_pinned_modules(run_dir: Path, what: str) -> None:
    """The modules ``dstt ls`` and ``dstt.open(run).steps`` load, pinned: numpy is the one
    package beyond the standard library and dstt, and dstt's are the read path's only."""
    code = f"RUN = {str(run_dir)!r}\n" + PINNED_CODE.format(stmt=PINNED[what])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.splitlines()[-1])
    packages = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names)
    assert packages == {"dstt", "numpy"}, (what, sorted(packages))
    extra = sorted(m for m in loaded if m.split(".")[0] == "dstt" and m not in READ_PATH)
    assert not extra, f"{what} loads dstt modules beyond the pinned read path: {extra}"
