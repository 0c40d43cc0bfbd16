"""One rank of the framework tests: the Hugging Face Trainer and Lightning on 2 gloo ranks.

``python frameworks_worker.py FRAMEWORK MODE RUN OUT STEPS [STRATEGY]`` with torchrun's
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*; the frameworks set up the process group
themselves). FRAMEWORK: ``hf`` or ``pl``; MODE: ``plain`` (no dstt: the reference), ``fresh``
(a DsttCallback, stopped at STEPS // 2) or ``resume`` (the callback resumes the run and trains
to STEPS). STRATEGY (Lightning): ``ddp`` or ``fsdp2`` (``ModelParallelStrategy``, FSDP2 in
``configure_model``). Writes ``OUT/<tag>.r<rank>.json``: the losses rank 0 saw per global step,
and this rank's sha256 of its parameters and optimizer state (its local shards under FSDP2).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "integrations"))
faulthandler.dump_traceback_later(int(os.environ.get("DSTT_TEST_HANG_S", "300")), exit=True)
torch.set_num_threads(1)


def local_hash(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of this rank's parameters and optimizer state (a DTensor's local shard)."""
    import hashlib

    def raw(t: torch.Tensor) -> bytes:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode() + raw(p))
    for st in opt.state.values():
        for k in sorted(st):
            h.update(k.encode() + (raw(st[k]) if torch.is_tensor(st[k]) else repr(st[k]).encode()))
    return h.hexdigest()


def run_hf(mode: str, run: str, out: str, steps: int) -> dict[str, Any]:
    from hf_setup import Recorder, tiny_gpt2, trainer

    from dstt.integrations.transformers import DsttCallback

    model = tiny_gpt2()
    rec = Recorder(stop_at=steps // 2 if mode == "fresh" else None)
    cbs: list[Any] = [rec]
    cb = None
    if mode != "plain":
        cb = DsttCallback(run=run, resume=(mode == "resume"))
        cbs.append(cb)
    tr = trainer(model, out, cbs, max_steps=steps, ddp_backend="gloo")
    tr.train(resume_from_checkpoint=cb.resume_from() if mode == "resume" else None)
    return {
        "losses": rec.losses,
        "start": rec.start,
        "hash": local_hash(model, tr.optimizer.optimizer),
        "world": tr.args.world_size,
    }


def run_pl(mode: str, run: str, steps: int, strategy: str) -> dict[str, Any]:
    import lightning
    from lightning.pytorch import Trainer
    from pl_setup import Recorder, ResumableLoader, TinyLM, loader

    from dstt.integrations.lightning import DsttCallback

    class Sharded(TinyLM):
        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for block in self.net.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    lightning.seed_everything(0, verbose=False)
    model = Sharded() if strategy == "fsdp2" else TinyLM()
    rec = Recorder(stop_at=steps // 2 if mode == "fresh" else None)
    cbs: list[Any] = [rec]
    if mode != "plain":
        cbs.append(DsttCallback(run=run, resume=(mode == "resume")))
    if strategy == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strat: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    else:
        from lightning.pytorch.strategies import DDPStrategy

        strat = DDPStrategy(process_group_backend="gloo")
    tr = Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy=strat,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=cbs,
        use_distributed_sampler=False,
    )
    tr.fit(model, ResumableLoader(loader()))
    return {
        "losses": rec.losses,
        "start": rec.start,
        "hash": local_hash(model, tr.optimizers[0]),
        "world": tr.world_size,
    }


def main() -> None:
    framework, mode, run, out, steps = sys.argv[1:6]
    rank = int(os.environ["RANK"])
    tag = os.environ.get("DSTT_TEST_TAG", f"{framework}-{mode}")
    try:
        if framework == "hf":
            res = run_hf(mode, run, str(Path(out) / f"{tag}-trainer"), int(steps))
        else:
            res = run_pl(mode, run, int(steps), sys.argv[6])
        res = {"ok": True, **res}
    except BaseException as e:
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    Path(out, f"{tag}.r{rank}.json").write_text(json.dumps(res, default=str))


if __name__ == "__main__":
    main()
