"""The shipped notebooks' execution time (issue 37: each <= 20 s), with a per-cell breakdown.

Runs each ``notebooks/*.ipynb`` the way ``tests/notebook/test_notebooks.py`` does (nbclient, a
kernel of this interpreter, runs into a temporary ``DSTT_NOTEBOOK_DIR``) and reports its wall
time and the CPU time of the kernel and its children (the flusher, the index job), in total
and per code cell: CPU time is what a quiet machine's wall time approaches, where a loaded
one's wall time mostly measures the neighbours. Probes between the cells read
``os.times()`` in the kernel. The load average before and after is recorded with the figures.

    python bench/notebook_bench.py [NAME ...] [--json out.json] [--cells]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "dstt-bench-python"
PROBE = "import os as _o; print('@@', *_o.times()[:4])"


def kernel_dir(tmp: Path) -> Path:
    spec = tmp / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "dstt bench",
                "language": "python",
            }
        )
    )
    return tmp / "jupyter"


def cpu_of(outputs: list[Any]) -> float:
    for o in outputs:  # the probe's line (output a cell left behind may come before it)
        for line in o.get("text", "").splitlines():
            if line.startswith("@@ "):
                return sum(float(x) for x in line.split()[1:5])
    raise RuntimeError("probe printed nothing")


def run_one(path: Path) -> dict[str, Any]:
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="nbbench-") as tmp_s:
        tmp = Path(tmp_s)
        os.environ["JUPYTER_PATH"] = str(kernel_dir(tmp))
        runs = tmp / "runs"
        runs.mkdir()
        os.environ["DSTT_NOTEBOOK_DIR"] = str(runs)
        client = nbclient.NotebookClient(
            nb, kernel_name=KERNEL, timeout=300, resources={"metadata": {"path": str(tmp)}}
        )
        probe = nbformat.v4.new_code_cell(PROBE)
        cells: list[dict[str, Any]] = []
        load0 = os.getloadavg()[0]
        t0 = time.perf_counter()
        with client.setup_kernel():
            kernel_up = time.perf_counter() - t0
            client.execute_cell(probe, 0)
            cpu_prev = cpu_of(probe.outputs)
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                t = time.perf_counter()
                client.execute_cell(cell, i)
                wall = time.perf_counter() - t
                probe = nbformat.v4.new_code_cell(PROBE)
                client.execute_cell(probe, i)
                cpu = cpu_of(probe.outputs)
                head = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
                cells.append({"cell": i, "wall_s": wall, "cpu_s": cpu - cpu_prev, "head": head})
                cpu_prev = cpu
        wall = time.perf_counter() - t0
    return {
        "notebook": path.stem,
        "wall_s": wall,
        "kernel_start_s": kernel_up,
        "cells_cpu_s": sum(c["cpu_s"] for c in cells),
        "load_before": load0,
        "load_after": os.getloadavg()[0],
        "cells": cells,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="notebook stems (default: all)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cells", action="store_true", help="print the per-cell breakdown")
    args = ap.parse_args()
    paths = sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.names:
        paths = [p for p in paths if p.stem in args.names]
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    results = []
    for p in paths:
        r = run_one(p)
        results.append(r)
        head = f"{r['notebook']:13} wall {r['wall_s']:6.1f} s"
        head += f"  kernel start {r['kernel_start_s']:4.1f} s  cells' CPU {r['cells_cpu_s']:6.1f} s"
        print(f"{head}  load {r['load_before']:.1f}/{r['load_after']:.1f}", flush=True)
        if args.cells:
            for c in r["cells"]:
                line = f"   [{c['cell']:2}] {c['wall_s']:6.2f} s  cpu {c['cpu_s']:6.2f} s"
                print(f"{line}  {c['head']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
