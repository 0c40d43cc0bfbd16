"""The engine's CPU per step, per thread and per function, on any tree (issue 38).

Runs one ``hotpath_bench.py`` workload with a checkpoint every iteration (dstt defaults) on
the dstt that ``PYTHONPATH`` selects — so the same script measures an old tree and a new
one — in two windows after a warm-up:

* **plain**: each engine thread's CPU (``pthread_getcpuclockid``, ns), the flusher child's
  (``/proc/<pid>/task/*/schedstat``), the training thread's, and the bench's figure
  (median ``StepMetrics.writer_cpu_s``); nothing instrumented;
* **profiled**: a ``cProfile`` (timer: the thread's CPU clock) per engine thread, enabled
  only inside each thread's per-step entry (copy ``Pipeline._copy``, writers
  ``FlatLane.write``, committer ``Committer._finish``) and on the training thread around the
  loop: calls and CPU per step of every function, dstt's entry points summed per thread.

    python bench/seamcpu_profile.py --label new --workload lin1200 --threads 2 --out X.json
    python bench/seamcpu_profile.py --compare old.json new.json [--json small.json]

Wall time is not measured (the machine is shared); CPU per call is, and calls are counted.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import importlib
import itertools
import json
import os
import pstats
import shutil
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dstt  # first: the tree PYTHONPATH names (``hotpath_bench`` puts this one's on the path)

#: (module, class, methods): each engine thread's per-step entry; the module is under
#: ``dstt.engine.capture`` since the engine has rooms, directly under ``dstt.engine`` before
ENTRIES = [
    ("pipeline", "Pipeline", ["_copy"]),
    ("flatwrite", "FlatLane", ["write", "write_segment"]),
    ("committer", "Committer", ["_finish"]),
]


def _engine_module(name: str) -> Any:
    try:
        return importlib.import_module(f"dstt.engine.capture.{name}")
    except ModuleNotFoundError:  # a tree from before the engine's rooms
        return importlib.import_module(f"dstt.engine.{name}")


def _thread_role(name: str) -> str:
    if name == "MainThread":
        return "training"
    if "commit" in name:
        return "committer"
    if "copy" in name:
        return "copy"
    if "writ" in name:
        return "writer"
    if "flusher" in name or "repl" in name:
        return "flusher-replies"
    return "other:" + name


def _child_ns() -> int:
    """CPU (ns, schedstat) of this process's child processes, all their threads."""
    total = 0
    me = str(os.getpid())
    for p in glob.glob("/proc/[0-9]*"):
        try:
            f = Path(p, "stat").read_text().rsplit(")", 1)[1].split()
            if f[1] != me:
                continue
            for t in glob.glob(f"{p}/task/*/schedstat"):
                total += int(Path(t).read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass
    return total


def _thread_cpu() -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for t in threading.enumerate():
        if t.ident is None:
            continue
        try:
            cid = time.pthread_getcpuclockid(t.ident)
            out[_thread_role(t.name)] += time.clock_gettime(cid)
        except (OSError, ProcessLookupError):
            pass
    return out


def _served_here(s: Any) -> int | None:
    """Requests the flusher served in this process (before its child was ready)."""
    pipe = getattr(s, "_pipeline", None)
    for owner in (getattr(pipe, "sink", None), getattr(pipe, "flat", None)):
        fl = getattr(owner, "flusher", None)
        if fl is not None:
            return int(getattr(fl, "served_here", -1))
    return None


class _Profiles:
    """One cProfile per thread, enabled only inside the wrapped entries while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.by_thread: dict[int, tuple[str, cProfile.Profile]] = {}
        self._undo: list[tuple[Any, str, Any]] = []
        self._depth = threading.local()

    def install(self) -> None:
        for mod, cls, names in ENTRIES:
            owner = getattr(_engine_module(mod), cls)
            for name in names:
                orig = getattr(owner, name)
                setattr(owner, name, self._wrap(orig))
                self._undo.append((owner, name, orig))

    def uninstall(self) -> None:
        for owner, name, orig in self._undo:
            setattr(owner, name, orig)

    def hold(self) -> None:
        self._depth.n = 1

    def profile(self) -> cProfile.Profile:
        tid = threading.get_ident()
        got = self.by_thread.get(tid)
        if got is None:
            prof = cProfile.Profile(time.thread_time)
            got = self.by_thread[tid] = (_thread_role(threading.current_thread().name), prof)
        return got[1]

    def _wrap(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            depth = getattr(self._depth, "n", 0)
            if not self.on or depth:
                return orig(*a, **k)
            prof = self.profile()
            self._depth.n = 1
            prof.enable()
            try:
                return orig(*a, **k)
            finally:
                prof.disable()
                self._depth.n = 0

        return wrapper


def _key(fn: tuple[str, int, str], root: str) -> str:
    file, _, name = fn
    if file == "~":
        return name
    if file.startswith(root):
        return "dstt/" + file[len(root) :].lstrip("/") + ":" + name
    return Path(file).name + ":" + name


def _summarize(st: dict[Any, Any], iters: int, root: str) -> dict[str, Any]:
    """Per step: the CPU entering dstt (from outside it), calls, and per-function rows."""
    in_dstt = 0.0
    calls = 0
    dstt_calls = 0
    funcs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for fn, (_cc, nc, tt, ct, callers) in st.items():
        mine = fn[0].startswith(root)
        calls += nc
        row = funcs[_key(fn, root)]
        row[0] += nc / iters
        row[1] += tt / iters * 1e3
        row[2] += ct / iters * 1e3
        if mine:
            dstt_calls += nc
            if not callers:  # a profiled entry itself
                in_dstt += ct
            for caller, edge in callers.items():
                if not caller[0].startswith(root):
                    in_dstt += edge[3]
    return {
        "dstt_cpu_ms": in_dstt / iters * 1e3,
        "calls": calls / iters,
        "dstt_calls": dstt_calls / iters,
        "funcs": {k: [round(v[0], 2), round(v[1], 4), round(v[2], 4)] for k, v in funcs.items()},
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import hotpath_bench as hb
    import torch

    root = str(Path(dstt.__file__).resolve().parent) + "/"
    torch.set_num_threads(args.threads)
    tr = hb.make_trainer(args.workload)
    for _ in range(3):
        tr.step()
    profs = _Profiles()
    profs.install()
    tmp = Path(tempfile.mkdtemp())
    out: dict[str, Any] = {
        "label": args.label,
        "workload": args.workload,
        "threads": args.threads,
        "dstt": root,
    }
    try:
        with dstt.session(tr.model, tr.opt, run=tmp / "run", every=1) as s:
            for _ in range(args.warmup):
                tr.step()
            time.sleep(0.5)
            # -- plain window ----------------------------------------------------------
            first = s.step
            a, ca, c0 = _thread_cpu(), _child_ns(), time.thread_time()
            for _ in range(args.iters):
                tr.step()
            s.wait()
            train = time.thread_time() - c0
            b, cb = _thread_cpu(), _child_ns()
            n = args.iters
            plain = {k: (b[k] - a.get(k, 0.0)) / n * 1e3 for k in b}
            plain["training"] = train / n * 1e3
            plain["flusher child"] = (cb - ca) / n / 1e6
            ms = [m for m in s.metrics if first < m.step <= first + n]
            out["plain_ms_per_step"] = {k: round(v, 4) for k, v in sorted(plain.items())}
            out["writer_cpu_ms_median"] = statistics.median(m.writer_cpu_s for m in ms) * 1e3
            out["writer_cpu_ms_mean"] = statistics.mean(m.writer_cpu_s for m in ms) * 1e3
            out["served_here"] = _served_here(s)
            # -- profiled window -------------------------------------------------------
            main = profs.profile()
            profs.on = True
            profs.hold()  # (an entry run on this thread is inside this profile already)
            main.enable()
            for _ in range(args.piters):
                tr.step()
            main.disable()
            s.wait()
            profs.on = False
    finally:
        profs.uninstall()
        shutil.rmtree(tmp, ignore_errors=True)
    by_role: dict[str, list[cProfile.Profile]] = defaultdict(list)
    for role, prof in profs.by_thread.values():
        by_role[role].append(prof)
    prof_out = {}
    for role, ps in by_role.items():
        merged = pstats.Stats(ps[0])
        for p in ps[1:]:
            merged.add(p)
        prof_out[role] = _summarize(merged.stats, args.piters, root)  # type: ignore[attr-defined]
    out["profiled"] = prof_out
    return out


def compare(paths: list[str], top: int) -> dict[str, Any]:
    """Old vs new: per thread the plain CPU, dstt CPU and calls per step, and the functions
    whose calls or own CPU per step changed most."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:  # (in the order given: the oldest tree first)
        for x in r if isinstance(r, list) else [r]:
            groups[(x["workload"], x["threads"])].append(x)
    out: dict[str, Any] = {
        "about": "ms and calls per step; plain: each thread's CPU, no profiler; profiled: "
        "cProfile (thread CPU clock) inside each engine thread's per-step entry, so its ms "
        "carry the profiler's overhead (compare calls, and ms only between trees)",
        "trees": {x["label"]: x["dstt"] for r in runs for x in (r if isinstance(r, list) else [r])},
    }
    for (wl, th), xs in sorted(groups.items()):
        key = f"{wl} threads {th}"
        rows: dict[str, Any] = {}
        for x in xs:
            rows[x["label"]] = {
                "writer_cpu_ms_median": round(x["writer_cpu_ms_median"], 3),
                "writer_cpu_ms_mean": round(x.get("writer_cpu_ms_mean", 0.0), 3),
                "plain_cpu_ms_per_step": x["plain_ms_per_step"],
                "profiled": {
                    role: {
                        "dstt_cpu_ms": round(p["dstt_cpu_ms"], 3),
                        "dstt_calls": round(p["dstt_calls"], 1),
                        "calls": round(p["calls"], 1),
                    }
                    for role, p in x["profiled"].items()
                },
            }
        for old, new in itertools.pairwise(xs):  # each tree against the one before
            diffs = []
            for role in new["profiled"]:
                fo = old["profiled"].get(role, {}).get("funcs", {})
                fn = new["profiled"][role]["funcs"]
                for f in set(fo) | set(fn):
                    if role == "training" and not f.startswith("dstt/"):
                        continue  # (torch's own calls vary with the run)
                    o, m = fo.get(f, [0, 0, 0]), fn.get(f, [0, 0, 0])
                    if abs(o[0] - m[0]) >= 0.5:
                        diffs.append((role, f, o, m))
            diffs.sort(key=lambda d: (d[0], -abs(d[3][1] - d[2][1])))
            rows[f"calls changed {old['label']} -> {new['label']}"] = [
                {
                    "thread": r,
                    "function": f,
                    "calls": [o[0], m[0]],
                    "own_ms_profiled": [round(o[1], 4), round(m[1], 4)],
                }
                for r, f, o, m in diffs[:top]
            ]
        out[key] = rows
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="tree")
    ap.add_argument("--workload", default="lin1200")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--piters", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.compare:
        res = compare(args.compare, args.top)
        text = json.dumps(res, indent=1)
        if args.json:
            Path(args.json).write_text(text + "\n")
        print(text)
        return
    res = measure(args)
    if args.out:
        p = Path(args.out)
        old = json.loads(p.read_text()) if p.exists() else []
        p.write_text(json.dumps([*old, res]) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "profiled"}, indent=1))
    for role, pr in res["profiled"].items():
        print(f"{role}: dstt {pr['dstt_cpu_ms']:.3f} ms/step, {pr['dstt_calls']:.0f} dstt calls")
        top = sorted(pr["funcs"].items(), key=lambda kv: -kv[1][1])[:12]
        for f, (nc, tt, ct) in top:
            print(f"   {nc:8.1f} calls {tt:8.4f} ms own {ct:8.4f} ms cum  {f}")


if __name__ == "__main__":
    main()
