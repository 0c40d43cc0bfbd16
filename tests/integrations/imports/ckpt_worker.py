"""One rank of the import tests' multi-rank checkpoints, run as a child process.

``python ckpt_worker.py KIND OUT`` with RANK/WORLD_SIZE/MASTER_* set (``conftest.spawn``).
KIND ``dcp``: a small model trained 3 steps (FSDP2 over a CPU mesh when WORLD_SIZE > 1), saved
with ``dcp.save`` at steps 2 and 3 (``OUT/step-<k>``), and the full state gathered by DCP's
``get_state_dict(full_state_dict=True)`` saved by rank 0 as ``OUT/ref-<k>.pt``.
KIND ``ds``: for ZeRO 2 and 3 a DeepSpeed engine trained 3 steps, ``save_checkpoint`` at
steps 2 and 3 (``OUT/z<stage>/global_step<k>``), and rank 0 saves DeepSpeed's own view of
every parameter's fp32 master and optimizer state (``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state``) as ``OUT/ref-z<stage>-<k>.pt``.
KIND ``dcpload`` (``ckpt_worker.py dcpload OUT SRC``): a fresh model and optimizer (FSDP2 when
WORLD_SIZE > 1) loaded from the DCP folder SRC the standard way (``get_state_dict`` →
``dcp.load`` → ``set_state_dict``); rank 0 saves the full state as ``OUT/loaded.pt``.
Writes ``OUT/done.r<rank>``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import traceback
from pathlib import Path

import torch

faulthandler.dump_traceback_later(int(os.environ.get("DSTT_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)


class Net(torch.nn.Module):
    """Odd sizes, so partitions split parameters across ranks and pad the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(8, 13)
        self.l2 = torch.nn.Linear(13, 5)
        self.norm = torch.nn.LayerNorm(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.l2(torch.relu(self.l1(x))))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 5, generator=g)


def groups(net: torch.nn.Module) -> list[dict]:
    decay = [p for n, p in net.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in net.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def sharded(world: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model (FSDP2 over a CPU mesh when ``world`` > 1) and its AdamW."""
    torch.manual_seed(seed)
    net = Net()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for m in (net.l1, net.l2):
            fully_shard(m, mesh=mesh)
        fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(groups(net), lr=1e-2)


def run_dcp(out: Path, rank: int, world: int) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    if world > 1:
        dist.init_process_group("gloo")
    net, opt = sharded(world)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    for k in range(1, 4):
        x, y = batch(k, rank)
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if k < 2:
            continue
        msd, osd = get_state_dict(net, opt)
        dcp.save(
            {"model": msd, "optimizer": osd, "lr_scheduler": sched.state_dict(), "step": k},
            checkpoint_id=str(out / f"step-{k}"),
        )
        full = get_state_dict(
            net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank == 0:
            torch.save({"model": full[0], "optimizer": full[1]}, out / f"ref-{k}.pt")
    if world > 1:
        dist.destroy_process_group()


def run_dcpload(out: Path, rank: int, world: int, src: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    if world > 1:
        dist.init_process_group("gloo")
    net, opt = sharded(world, seed=7)  # other values than any checkpoint's
    msd, osd = get_state_dict(net, opt)
    state = {"model": msd, "optimizer": osd}
    dcp.load(state, checkpoint_id=src)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    full = get_state_dict(
        net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"model": full[0], "optimizer": full[1]}, out / "loaded.pt")
    if world > 1:
        dist.destroy_process_group()


def run_ds(out: Path, rank: int, world: int) -> None:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (2, 3):
        torch.manual_seed(0)
        net = Net()
        opt = torch.optim.AdamW(groups(net), lr=1e-2)
        cfg = {
            "train_micro_batch_size_per_gpu": 4,
            "steps_per_print": 10**9,
            "zero_optimization": {"stage": stage},
            "wall_clock_breakdown": False,
        }
        engine, *_ = deepspeed.initialize(model=net, optimizer=opt, config=cfg)
        for k in range(1, 4):
            x, y = batch(k, rank)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
            if k < 2:
                continue
            engine.save_checkpoint(str(out / f"z{stage}"), tag=f"global_step{k}")
            # ZeRO-2 links each parameter to its optimizer state once, at the first step,
            # before the state exists: link again so its own accessors find the state
            if stage == 2:
                engine.optimizer._hp_optimizer_states_linked = False
                engine.optimizer._lazy_init_hp_params_optimizer_state()
            ref = {}
            for name, p in engine.module.named_parameters():
                ref[name] = {
                    "fp32": safe_get_full_fp32_param(p),
                    **{s: safe_get_full_optimizer_state(p, s) for s in ("exp_avg", "exp_avg_sq")},
                }
            if rank == 0:
                torch.save(ref, out / f"ref-z{stage}-{k}.pt")


def main() -> None:
    kind, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        if kind == "dcpload":
            run_dcpload(out, rank, world, sys.argv[3])
        else:
            (run_dcp if kind == "dcp" else run_ds)(out, rank, world)
    except BaseException:
        (out / f"error.r{rank}").write_text(traceback.format_exc())
        os._exit(1)
    (out / f"done.r{rank}").write_text("ok")


if __name__ == "__main__":
    main()
