"""dstt under FSDP2 on two CPU ranks: capture every step, resume, then inspect in one process.

    torchrun --nproc-per-node 2 examples/distributed.py [RUN] [--parallel ddp]

Every rank runs the same ``dstt.session(...)``: each writes its own shards, rank 0 commits a
step once both are durable. The second session resumes the run bit-exactly on both ranks. At
the end rank 0 opens the run the way a notebook would (no process group involved) and shows
whole tensors under the model's own names. ``--parallel`` picks ``fsdp`` (FSDP2, default),
``ddp`` or ``tp`` (tensor parallel).
"""

from __future__ import annotations

import argparse
import os
import shutil

import torch
import torch.distributed as dist

import dstt
from dstt.testing.models import TinyGPT, make_batch


def build(parallel: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model: torch.nn.Module = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16)
    world = dist.get_world_size()
    if parallel == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif parallel == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:  # type: ignore[union-attr]
            parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, s: dstt.Session, steps: int, data_rank: int
) -> None:
    for step in range(s.step, steps):
        x, y = make_batch(step, seed=data_rank)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        s.log(loss=loss.item())  # rank 0's are committed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run", nargs="?", default="runs/distributed-demo")
    ap.add_argument("--parallel", choices=["fsdp", "ddp", "tp"], default="fsdp")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data_rank = 0 if args.parallel == "tp" else rank  # TP ranks of a group share the input
    if rank == 0:
        shutil.rmtree(args.run, ignore_errors=True)
    dist.barrier()

    model, opt = build(args.parallel)
    with dstt.session(model, opt, run=args.run) as s:  # on every rank
        train(model, opt, s, 10, data_rank)
    model, opt = build(args.parallel)  # a fresh model: as after a restart
    with dstt.session(model, opt, run=args.run, resume=True) as s:
        if rank == 0:
            print(f"[{type(s).__name__}, {s.world} ranks] resumed at step {s.step}")
        train(model, opt, s, 15, data_rank)

    if rank == 0:  # inspection needs no process group: whole tensors, the model's names
        run = dstt.open(args.run)
        print(f"steps: {run.steps[0]}..{run.steps[-1]}; names: {run.at(15).names()[:4]} ...")
        w = run.at(15).tensor("layers.0.mlp.0.weight")
        print(f"layers.0.mlp.0.weight {tuple(w.shape)} (stored in shards, read whole)")
        print(run.metrics()["loss"].to_series().tail(3).to_string())
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
