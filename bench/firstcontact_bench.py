"""First contact (issue 37): what a newcomer's first commands cost, each in a fresh process.

Every figure is the median wall time of ``--repeats`` (>= 5) fresh interpreters, from spawn to
exit, and their CPU time (user + system, which a loaded machine inflates far less), with
bytecode caches warm (one untimed run first; ``PYTHONDONTWRITEBYTECODE`` is dropped for the
children, as a user's machine has ``__pycache__``). ``bare`` is ``python -c pass``;
each line also reports its cost beyond that. On runs of ``--steps`` (default 300, 3,000 and
10,000) steps of 12 tiny tensors, built once through ``bench/index_bench.py``'s synthesizer
(with a write-time ``summaries`` object and one loss spike per run):

* ``import``: ``import dstt``; ``help``: ``dstt --help``;
* ``ls``, ``log`` (``-n 20``), ``show`` (``--step`` the middle step): the CLI;
* ``steps``: ``dstt.open(run).steps``;
* ``metrics``: a first ``run.metrics()`` and its ``loss`` values as numpy;
* ``metrics_xarray``: the same as a pandas Series (``m["loss"].to_series()``: xarray built);
* ``layer``: a first tensor read, ``run.at(k).layer("layers.1").load()``.

Goals: <= 0.3 s for the index-only lines (import, help, ls, log, show, steps, metrics) at
10,000 steps (metrics: at 3,000), <= 1 s for ``layer``.

``--session``: a session's fixed cost — 8 iterations of a small MLP (AdamW) with no
checkpointing, with ``dstt.session(..., every=1)`` (start and close included), and with
``torch.save`` of model and optimizer every step; each a fresh process, the loop timed inside
it from before the session starts to after it closes (the session's start, loop and close
also apart; and the CPU time of the process and its reaped children, the flusher, which a
loaded machine inflates less), the trees and modes interleaved per repeat. Goal: dstt <=
none + 0.2 s.

``--before DIR`` also times another source tree (e.g. ``git archive main | tar -x -C
/tmp/main``) on the same runs, each line alternating between the two trees so that a changing
load hits both alike: the before/after figures of docs/performance.md. The machine may be
shared and loaded: say so with the figures; the lead reruns it quiet.

    python bench/firstcontact_bench.py [--steps 300,3000,10000] [--repeats 5] [--before DIR]
                                       [--session] [--dir DIR] [--json PATH] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import source_state  # noqa: E402
from bench.index_bench import synthesize  # noqa: E402

TENSORS, SHAPE = 12, (4, 4)
METRICS = (
    "import dstt\nm = dstt.open(RUN).metrics()\n"
    "v = m.column('loss') if hasattr(m, 'column') else m['loss'].values\nassert len(v)"
)
SESSION = r"""
import json, os, resource, sys, tempfile, time
import torch
mode, out = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(32, 128)

def step():
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss

def cpu():  # this process's threads and its reaped children (the flusher)
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ru.ru_utime + ru.ru_stime

t0, c0 = time.perf_counter(), cpu()
phases = {}
if mode == "dstt":
    import dstt
    with dstt.session(model, opt, run=os.path.join(out, "run"), every=1) as s:
        phases["start"] = time.perf_counter() - t0
        for _ in range(8):
            s.log(loss=float(step()))
        t1 = time.perf_counter()
        phases["loop"] = t1 - t0 - phases["start"]
    phases["close"] = time.perf_counter() - t1
elif mode == "save":
    for i in range(8):
        step()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   os.path.join(out, f"ckpt{i}.pt"))
else:
    for _ in range(8):
        step()
print(json.dumps({"total": time.perf_counter() - t0, "cpu": cpu() - c0, **phases}))
"""
SESSION_MODES = ("none", "dstt", "save")


def child_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(tree)
    env["PYTHONHASHSEED"] = "0"
    return env


def _run(argv: list[str], env: dict[str, str]) -> None:
    # in the tree's own folder: ``python -c``/``-m`` put the working directory first on
    # sys.path, so from another checkout that checkout's dstt would be timed instead
    subprocess.run(
        argv, env=env, cwd=env["PYTHONPATH"], check=True, capture_output=True, timeout=600
    )


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(
    argv: list[str], envs: list[dict[str, str]], repeats: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Wall seconds and CPU seconds (user + system: what a loaded machine inflates least) of
    ``argv`` in fresh processes, per environment (tree), the trees alternating; one untimed
    warm-up each first."""
    for env in envs:
        _run(argv, env)
    times: list[list[float]] = [[] for _ in envs]
    cpus: list[list[float]] = [[] for _ in envs]
    for _ in range(repeats):
        for env, got, cpu in zip(envs, times, cpus, strict=True):
            c0, t0 = _children_cpu(), time.perf_counter()
            _run(argv, env)
            got.append(time.perf_counter() - t0)
            cpu.append(_children_cpu() - c0)
    return times, cpus


def commands(run: Path, steps: int) -> dict[str, list[str]]:
    py, r = sys.executable, str(run)
    code = f"RUN = {r!r}\n"
    return {
        "import": [py, "-c", "import dstt"],
        "help": [py, "-m", "dstt.cli", "--help"],
        "ls": [py, "-m", "dstt.cli", "ls", r],
        "log": [py, "-m", "dstt.cli", "log", "-n", "20", r],
        "show": [py, "-m", "dstt.cli", "show", "--step", str(steps // 2), r],
        "steps": [py, "-c", code + "import dstt\nassert dstt.open(RUN).steps"],
        "metrics": [py, "-c", code + METRICS],
        "metrics_xarray": [
            py,
            "-c",
            code + "import dstt\nassert len(dstt.open(RUN).metrics()['loss'].to_series())",
        ],
        "layer": [
            py,
            "-c",
            code + f"import dstt\ndstt.open(RUN).at({steps // 2}).layer('layers.1').load()",
        ],
    }


def _session_once(env: dict[str, str], mode: str, d: Path) -> dict[str, float]:
    d.mkdir()
    try:
        got = subprocess.run(
            [sys.executable, "-c", SESSION, mode, str(d)],
            env=env,
            cwd=env["PYTHONPATH"],
            check=True,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)
    out: dict[str, float] = json.loads(got.stdout.splitlines()[-1])
    return out


def bench_session(
    trees: dict[str, dict[str, str]], repeats: int, root: Path
) -> dict[str, dict[str, Any]]:
    """Per tree: the 8-iteration loop with no checkpointing, under a session and with
    ``torch.save`` every step, each in a fresh process, in-process wall time from before
    ``import dstt`` to after the session's close (and, for the session, its start, loop and
    close). Every repeat runs each tree and mode once, interleaved, so that a changing load
    hits them alike; one untimed round first (caches)."""
    got: dict[str, dict[str, list[dict[str, float]]]] = {
        t: {m: [] for m in SESSION_MODES} for t in trees
    }
    for i in range(repeats + 1):
        for tree, env in trees.items():
            for mode in SESSION_MODES:
                r = _session_once(env, mode, root / f"session-{tree}-{mode}-{i}")
                if i:
                    got[tree][mode].append(r)
    res: dict[str, dict[str, Any]] = {}
    for tree, modes in got.items():
        out: dict[str, Any] = {"iterations": 8, "model": "4 x Linear(128, 128), AdamW"}
        for mode, runs in modes.items():
            times = [r["total"] for r in runs]
            out[f"{mode}_s"] = statistics.median(times)
            out[f"{mode}_all_s"] = times
            out[f"{mode}_cpu_s"] = statistics.median(r["cpu"] for r in runs)
            out[f"{mode}_all_cpu_s"] = [r["cpu"] for r in runs]
        for phase in ("start", "loop", "close"):
            out[f"dstt_{phase}_s"] = statistics.median(r[phase] for r in modes["dstt"])
        out["dstt_over_none_s"] = out["dstt_s"] - out["none_s"]
        out["save_over_none_s"] = out["save_s"] - out["none_s"]
        out["dstt_over_none_cpu_s"] = out["dstt_cpu_s"] - out["none_cpu_s"]
        out["save_over_none_cpu_s"] = out["save_cpu_s"] - out["none_cpu_s"]
        out["dstt_ratio"] = out["dstt_s"] / out["none_s"]
        out["save_ratio"] = out["save_s"] / out["none_s"]
        res[tree] = out
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="300,3000,10000")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--before", default=None, help="another dstt source tree, timed alike")
    ap.add_argument("--session", action="store_true", help="also a session's fixed cost")
    ap.add_argument("--only", default=None, help="comma-separated lines (default: all)")
    ap.add_argument("--dir", default=None, help="where the runs are built (kept there)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "firstcontact.json"))
    ap.add_argument("--quick", action="store_true", help="100 steps, 5 repeats (smoke test)")
    args = ap.parse_args()
    steps = [100] if args.quick else [int(s) for s in args.steps.split(",")]
    repeats = args.repeats
    if repeats < 5:
        print(f"{repeats} repeats: fewer than the 5 the figures want; say so", flush=True)
    trees = {"after": ROOT} | ({"before": Path(args.before).resolve()} if args.before else {})
    envs = [child_env(t) for t in trees.values()]
    keep = args.dir is not None
    root = Path(args.dir) if keep else Path(tempfile.mkdtemp(prefix="firstcontact-"))
    root.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else None
    res: dict[str, Any] = {
        "benchmark": "firstcontact",
        "quick": args.quick,
        "repeats": repeats,
        "trees": {k: str(v) for k, v in trees.items()},
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "load_before": os.getloadavg(),
        "source": source_state(),
        "runs": {},
        "note": "fresh process per figure, warm bytecode caches; a shared machine is noisy",
    }
    try:
        bare_t, bare_c = timed([sys.executable, "-c", "pass"], envs[:1], repeats)
        bare, bare_cpu = statistics.median(bare_t[0]), statistics.median(bare_c[0])
        res["bare_s"], res["bare_cpu_s"] = bare, bare_cpu
        print(f"bare interpreter: {bare:.3f} s wall, {bare_cpu:.3f} s cpu", flush=True)
        for n in steps:
            run = root / f"run{n}"
            if not (run / "zarr.json").exists():
                shutil.rmtree(run, ignore_errors=True)
                synthesize(run, n, tensors=TENSORS, shape=SHAPE)
            got: dict[str, Any] = {}
            for name, argv in commands(run, n).items():
                if only is not None and name not in only:
                    continue
                per_tree, per_tree_cpu = timed(argv, envs, repeats)
                line = []
                for tree, all_t, all_c in zip(trees, per_tree, per_tree_cpu, strict=True):
                    t, c = statistics.median(all_t), statistics.median(all_c)
                    got.setdefault(name, {})[tree] = {
                        "s": t,
                        "over_bare_s": t - bare,
                        "all_s": all_t,
                        "cpu_s": c,
                        "cpu_over_bare_s": c - bare_cpu,
                        "all_cpu_s": all_c,
                    }
                    line.append(f"{tree} {t:.3f} s wall, {c:.3f} s cpu")
                print(f"{n:>6} steps  {name:<15} {'  '.join(line)}", flush=True)
            res["runs"][str(n)] = got
        if args.session:
            res["session"] = bench_session(dict(zip(trees, envs, strict=True)), repeats, root)
            print(json.dumps(res["session"], indent=1), flush=True)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    res["load_after"] = os.getloadavg()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
