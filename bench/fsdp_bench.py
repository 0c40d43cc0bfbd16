"""Per-iteration cost of a checkpoint every step under FSDP2 on two ranks (issue 26).

Two gloo ranks on the CPU (this script spawns them) train ``dstt.testing.models.TinyGPT``
(``--layers`` blocks: 100+ parameter tensors, 300+ arrays with AdamW state), each block and the
root wrapped with ``fully_shard`` (FSDP2: every parameter a DTensor ``Shard(0)``). Each round
runs every mode in a rotated order — ``--warmup`` untimed then ``--iters`` timed iterations,
each mode on a fresh model with the same seed:

* ``none``        no checkpointing: the baseline of every ratio;
* ``dstt``        ``dstt.session(model, opt, run=...)`` on both ranks, every step captured
                  (each rank copies its local shards lazily and writes its own step file;
                  rank 0 commits once both are durable);
* ``dcp_async``   ``torch.distributed.checkpoint.async_save`` of ``get_state_dict(model, opt)``
                  every step (sharded state dicts: each rank writes its shards) on a gloo group
                  of its own, the previous save's future awaited before the next one, as DCP's
                  docs do; two folders alternate so the disk holds two checkpoints.

Timing is rank 0's wall time for the timed iterations plus the final flush (dstt: the session's
close; DCP: the last future), over N, with a barrier before and after, so both ranks' costs
count. Reported per mode: the median over rounds of s/iter and the median of per-round ratios
to ``none``; ``blocked``: dstt's per-step wait for its copies (the only time it blocks
training) and DCP's wait for its previous save plus its ``async_save`` call (the staging it
does on the training thread). Bytes per step per rank: dstt's step file and DCP's ``.distcp``
file of each rank.

    python bench/fsdp_bench.py [--quick] [--rounds 3] [--iters 20] [--layers 8]
                               [--json bench/results/fsdp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("none", "dstt", "dcp_async")
SIZE = dict(vocab=2048, d=128, layers=8, heads=4, seq=64, batch=8)
QUICK = dict(vocab=128, d=32, layers=8, heads=2, seq=16, batch=4)


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- one rank -------------------------------------------------------------------------------
def _rank_main(cfg: dict[str, Any]) -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    # DCP's async save plans with collectives from its own thread: on a group of its own (as
    # its docs advise), else they interleave with FSDP's on the default group
    cfg["dcp_group"] = dist.new_group(backend="gloo")
    size = cfg["size"]
    out: dict[str, Any] = {"rounds": []}
    work = Path(cfg["work"])
    for rnd in range(cfg["rounds"]):
        order = MODES[rnd % len(MODES) :] + MODES[: rnd % len(MODES)]
        row: dict[str, Any] = {}
        for mode in order:
            row[mode] = _run_mode(mode, size, cfg, mesh, work / f"r{rnd}-{mode}", rank)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(work / f"r{rnd}-{mode}", ignore_errors=True)
            dist.barrier()
        out["rounds"].append(row)
    Path(cfg["out"]).joinpath(f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _model(size: dict[str, int], mesh: Any) -> tuple[Any, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    from dstt.testing.models import TinyGPT

    torch.manual_seed(0)
    m = TinyGPT(
        vocab=size["vocab"],
        d=size["d"],
        layers=size["layers"],
        heads=size["heads"],
        seq=size["seq"],
        dropout=0.0,
    )
    for block in m.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=1e-3)


def _run_mode(
    mode: str, size: dict[str, int], cfg: dict[str, Any], mesh: Any, path: Path, rank: int
) -> dict[str, Any]:
    import torch.distributed as dist

    import dstt
    from dstt.testing.models import make_batch

    model, opt = _model(size, mesh)
    warmup, iters = cfg["warmup"], cfg["iters"]

    def step(i: int) -> None:
        x, y = make_batch(
            i, batch_size=size["batch"], seq=size["seq"], vocab=size["vocab"], seed=rank
        )
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    res: dict[str, Any] = {}
    if mode == "none":
        for i in range(warmup):
            step(i)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + iters):
            step(i)
        dist.barrier()
        res["s"] = time.perf_counter() - t0
    elif mode == "dstt":
        s = dstt.session(model, opt, run=path, rank_timeout=300)
        s.start()
        for i in range(warmup):
            step(i)
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + iters):
            step(i)
        s.close()
        dist.barrier()
        res["s"] = time.perf_counter() - t0
        ms = s.metrics[warmup:]
        res["blocked_ms"] = med([m.blocked_s * 1e3 for m in ms])
        files = sorted((path / "steps").glob("*.zip")) if rank == 0 else []
        res["bytes_per_rank"] = _step_file_bytes(files)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        future = None
        blocked: list[float] = []

        def save(i: int) -> None:
            nonlocal future
            t = time.perf_counter()
            if future is not None:
                future.result()
            msd, osd = get_state_dict(model, opt)
            future = dcp.async_save(
                {"model": msd, "optim": osd},
                checkpoint_id=str(path / f"c{i % 2}"),
                process_group=cfg["dcp_group"],
            )
            blocked.append(time.perf_counter() - t)

        for i in range(warmup):
            step(i)
            save(i)
        dist.barrier()
        blocked.clear()
        t0 = time.perf_counter()
        for i in range(warmup, warmup + iters):
            step(i)
            save(i)
        if future is not None:
            future.result()
        dist.barrier()
        res["s"] = time.perf_counter() - t0
        res["blocked_ms"] = med([b * 1e3 for b in blocked])
        if rank == 0:
            last = path / f"c{(warmup + iters - 1) % 2}"
            res["bytes_per_rank"] = sorted(f.stat().st_size for f in last.glob("*.distcp"))
    res["s_per_iter"] = res["s"] / iters
    return res


def _step_file_bytes(files: list[Path]) -> list[int]:
    """Bytes of the last committed step's file of each rank (``<slot>.zip``,
    ``<slot>.r00001.zip``)."""
    if not files:
        return []
    last = max(int(f.name.split(".")[0]) for f in files)
    return sorted(f.stat().st_size for f in files if int(f.name.split(".")[0]) == last)


# -- the parent -----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    size = dict(QUICK if args.quick else SIZE)
    size["layers"] = args.layers or size["layers"]
    work = Path(tempfile.mkdtemp(prefix="dstt-fsdp-bench-", dir=args.dir))
    out = work / "out"
    out.mkdir()
    cfg = {
        "size": size,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "work": str(work),
        "out": str(out),
    }
    port = _free_port()
    procs = []
    try:
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--rank-main", json.dumps(cfg)], env=env
                )
            )
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a rank failed: exit codes {codes}")
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
    rounds = ranks[0]["rounds"]
    summary: dict[str, Any] = {}
    for mode in MODES:
        per = [r[mode]["s_per_iter"] for r in rounds]
        ratios = [r[mode]["s_per_iter"] / r["none"]["s_per_iter"] for r in rounds]
        summary[mode] = {
            "s_per_iter": med(per),
            "ratio": med(ratios),
            "ratios": ratios,
            "blocked_ms": med([r[mode].get("blocked_ms", 0.0) for r in rounds]),
            "bytes_per_rank": rounds[-1][mode].get("bytes_per_rank", []),
        }
    n_params = sum(1 for _ in _count_tensors(size))
    return {
        "bench": "fsdp",
        "size": size,
        "tensors": n_params,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "iters": args.iters,
        "world": 2,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "summary": summary,
        "per_round": rounds,
    }


def _count_tensors(size: dict[str, int]) -> Any:
    sys.path.insert(0, str(ROOT))
    from dstt.testing.models import TinyGPT

    m = TinyGPT(
        vocab=size["vocab"],
        d=size["d"],
        layers=size["layers"],
        heads=size["heads"],
        seq=size["seq"],
    )
    return m.parameters()


def print_table(res: dict[str, Any]) -> None:
    print(
        f"FSDP2, 2 gloo ranks, TinyGPT {res['size']} ({res['tensors']} parameter tensors), "
        f"{res['rounds']} rounds x {res['iters']} iterations"
    )
    print("| mode | s/iter | ratio to none | blocked ms/step | bytes per step per rank |")
    print("|---|---:|---:|---:|---|")
    for mode, s in res["summary"].items():
        sizes = ", ".join(f"{b / 1e6:.2f} MB" for b in s["bytes_per_rank"])
        print(
            f"| {mode} | {s['s_per_iter'] * 1e3:.1f} ms | {s['ratio']:.2f}x | "
            f"{s['blocked_ms']:.2f} | {sizes} |"
        )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank-main", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="a tiny model (smoke test)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--dir", default=None, help="where runs are written (a temp dir in it)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rank_main:
        _rank_main(json.loads(args.rank_main))
        return {}
    res = run(args)
    print_table(res)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
