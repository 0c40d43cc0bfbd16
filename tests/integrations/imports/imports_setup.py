"""Helpers the import tests share (the fixtures are in ``conftest.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["free_port", "hf_trainer", "spawn"]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE / "ckpt_worker.py"
TIMEOUT = 420  # s per spawn; includes DeepSpeed's one-time g++ build on a fresh machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(kind: str, world: int, out: Path, ports: list[int], *args: str) -> None:
    """Run ``ckpt_worker.py KIND OUT ARGS...`` on ``world`` gloo ranks; raise with the logs if
    a rank failed."""
    port = free_port()
    ports.append(port)
    procs = []
    logs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "DS_BUILD_OPS": "0",
            "DSTT_TEST_HANG_S": str(TIMEOUT),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        log = open(out / f"log.r{rank}", "wb")  # noqa: SIM115 - closed once the ranks ended
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), kind, str(out), *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + TIMEOUT
    try:
        for p in procs:
            try:
                p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
    finally:
        for log in logs:
            log.close()
    for rank in range(world):
        if not (out / f"done.r{rank}").exists():
            log = (out / f"log.r{rank}").read_text(errors="replace")[-3000:]
            raise AssertionError(f"{kind} rank {rank}/{world} failed:\n{log}")


def _hf_args(out: Path, **kw: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=3e-3,
        warmup_steps=2,
        weight_decay=0.1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
        **kw,
    )


def hf_trainer(out: Path, callbacks: list[Any], **kw: Any) -> Any:
    from hf_setup import dataset, tiny_gpt2
    from transformers import Trainer

    return Trainer(
        model=tiny_gpt2(), args=_hf_args(out, **kw), train_dataset=dataset(), callbacks=callbacks
    )
