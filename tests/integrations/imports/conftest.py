"""Real checkpoints of every framework, built once per test session, for the import tests.

* ``hf_checkpoints``: a Hugging Face Trainer run (tiny GPT-2, 6 steps, ``save_strategy="steps"``
  every 2) — ``checkpoint-2/4/6`` — and ``hf_reference``: the Trainer's own
  ``resume_from_checkpoint="checkpoint-4"`` to step 6 (losses and final state hash);
* ``multirank``: child processes (``ckpt_worker.py``) on 1 and 2 gloo ranks: ``dcp.save`` of an
  FSDP2 model (plain on 1 rank) and DeepSpeed ZeRO-2/3 ``save_checkpoint``, each with the
  framework's own full view of the state as the reference;
* ``lightning_checkpoints``: a Lightning run with ``ModelCheckpoint(every_n_train_steps=2)``.

Import tests read these folders and never change them (a test that damages one copies it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from imports_setup import spawn  # noqa: E402 - after the path is set


@pytest.fixture(scope="session")
def multirank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """``{"dcp1", "dcp2", "ds1", "ds2"}`` -> the folder each world size wrote."""
    base = tmp_path_factory.mktemp("multirank")
    ports: list[int] = []
    shm = Path("/dev/shm")
    before = {p.name for p in shm.iterdir()} if shm.is_dir() else set()
    out = {}
    try:
        for kind in ("dcp", "ds"):
            for world in (1, 2):
                d = base / f"{kind}{world}"
                d.mkdir()
                spawn(kind, world, d, ports)
                out[f"{kind}{world}"] = d
        yield out
    finally:
        if shm.is_dir():  # DeepSpeed's shared-memory files for our ports
            for p in shm.iterdir():
                if p.name not in before and (
                    "deepspeed" in p.name or any(f"_{port}" in p.name for port in ports)
                ):
                    with contextlib.suppress(OSError):
                        p.unlink()


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Trainer's ``output_dir`` holding ``checkpoint-2``, ``-4`` and ``-6``."""
    from imports_setup import hf_trainer

    out = tmp_path_factory.mktemp("hf") / "out"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf_trainer(out, [], save_strategy="steps", save_steps=2).train()
    finally:
        torch.set_num_threads(n)
    return out


@pytest.fixture(scope="session")
def hf_reference(hf_checkpoints: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Trainer's own resume from ``checkpoint-4`` to step 6: losses, final state hash."""
    from hf_setup import Recorder, state_hash
    from imports_setup import hf_trainer

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rec = Recorder()
        tr = hf_trainer(tmp_path_factory.mktemp("hfref"), [rec], save_strategy="no")
        tr.train(resume_from_checkpoint=str(hf_checkpoints / "checkpoint-4"))
    finally:
        torch.set_num_threads(n)
    return {"losses": rec.losses, "hash": state_hash(tr.model, tr.optimizer.optimizer)}


@pytest.fixture(scope="session")
def lightning_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning's ``ModelCheckpoint`` dirpath: ``epoch=0-step={2,4,6}.ckpt``."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from pl_setup import loader, model

    out = tmp_path_factory.mktemp("pl") / "ckpts"
    ck = ModelCheckpoint(dirpath=str(out), every_n_train_steps=2, save_top_k=-1)
    t = Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[ck],
    )
    t.fit(model(), loader())
    return out
