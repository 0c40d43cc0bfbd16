"""Import throughput (issue 31): ``dstt.import_checkpoints`` against the framework's own loader.

A real Hugging Face Trainer run (GPT-2 shape: 4 layers, width 256, vocabulary 8192; AdamW)
saves a checkpoint every 2 steps (``save_strategy="steps"``). Then, on the same folders:

1. **the framework's own loader**: what the Trainer reads to resume, per checkpoint —
   ``safetensors.torch.load_file(model.safetensors)``, ``torch.load(optimizer.pt /
   scheduler.pt, weights_only=True)``, ``rng_state.pth`` (with the Trainer's numpy
   allowlist), ``trainer_state.json``;
2. **dstt's read phase**: the importer's reader alone (``from_hf.read_hf``: the same files plus
   naming the optimizer's parameters), nothing written;
3. **import**: ``import_checkpoints`` into a new run — default (write-time summaries on),
   ``summaries=False``, and ``encoding=DeltaPolicy()`` — every commit durable (the store's
   barrier per commit).

Each is timed *cold* (every source file evicted from the page cache with
``posix_fadvise(DONTNEED)`` first: a Monday-morning import of runs on disk) and *warm* (read
once just before). Throughput = source bytes / seconds; the ratio is import throughput /
loader throughput (the issue's target: >= 0.8). Beside them: the disk's write bandwidth with
fsync measured in this run (an import writes at least the source's bytes durably, which bounds
it: ``disk_bound_s``), and bytes on disk of the source folder and of each imported run.

    python bench/import_bench.py [--quick] [--json PATH] [--dir TMP]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integrations"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench._common import disk_bandwidth, finish, source_state  # noqa: E402


def make_checkpoints(out: Path, steps: int, quick: bool) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    width, vocab = (64, 512) if quick else (256, 8192)
    cfg = GPT2Config(
        n_layer=4,
        n_embd=width,
        n_head=4,
        vocab_size=vocab,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(64):
        ids = torch.randint(0, vocab, (64,), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=2,
        logging_steps=1,
        learning_rate=1e-3,
        weight_decay=0.1,
        report_to=[],
        save_strategy="steps",
        save_steps=2,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=GPT2LMHeadModel(cfg), args=args, train_dataset=data).train()


def files_of(src: Path) -> list[str]:
    return sorted(f for f in glob.glob(str(src / "checkpoint-*" / "*")) if os.path.isfile(f))


def evict(files: list[str]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def loader(src: Path) -> None:
    """The Trainer's own reads of every checkpoint (what resume_from_checkpoint loads)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file

    allow = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    for ck in sorted(src.glob("checkpoint-*")):
        load_file(ck / "model.safetensors")
        torch.load(ck / "optimizer.pt", weights_only=True)
        torch.load(ck / "scheduler.pt", weights_only=True)
        with torch.serialization.safe_globals(allow):
            torch.load(ck / "rng_state.pth", weights_only=True)
        json.loads((ck / "trainer_state.json").read_text())


def read_phase(src: Path) -> None:
    """dstt's readers alone, every tensor's bytes read once (a CRC-32, as the writer's
    checksum reads them; memory-mapped tensors are read here), nothing written."""
    import zlib

    from dstt.engine.tensors._convert import flat_bytes
    from dstt.integrations.imports.from_hf import read_hf
    from dstt.integrations.imports.write import arrays_of

    for ck in sorted(src.glob("checkpoint-*")):
        for t in arrays_of(read_hf(str(ck))).values():
            zlib.crc32(flat_bytes(t.contiguous()).numpy())


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed(fn: Any, files: list[str], cold: bool) -> float:
    if cold:
        evict(files)
    else:
        warm(files)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="4 checkpoints of a width-64 model (a smoke test: numbers mean nothing)",
    )
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "import.json"))
    ap.add_argument("--dir", default=None, help="folder for the temporary files")
    a = ap.parse_args(argv)
    import torch

    import dstt

    t_start = time.perf_counter()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp(prefix="dstt-import-bench-", dir=a.dir))
    res: dict[str, Any] = {
        "benchmark": "import",
        "quick": a.quick,
        "source": source_state(),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
            "torch_threads": torch.get_num_threads(),
        },
    }
    try:
        src = tmp / "hf"
        make_checkpoints(src, 8 if a.quick else 16, a.quick)
        files = files_of(src)
        nbytes = sum(os.path.getsize(f) for f in files)
        res["checkpoints"] = len(list(src.glob("checkpoint-*")))
        res["source_bytes"] = nbytes
        res["disk_write_fsync_GBps"] = disk_bandwidth(tmp, 256 << 20) / 1e9
        variants = {
            "import": {},
            "import_no_summaries": {"summaries": False},
            "import_delta": {"encoding": dstt.DeltaPolicy()},
        }
        for mode in ("cold", "warm"):
            cold = mode == "cold"
            row: dict[str, Any] = {}
            row["loader_s"] = timed(lambda: loader(src), files, cold)
            row["read_phase_s"] = timed(lambda: read_phase(src), files, cold)
            for name, kw in variants.items():
                run = tmp / f"run-{name}-{mode}"
                row[f"{name}_s"] = timed(
                    lambda run=run, kw=kw: dstt.import_checkpoints(src, run, **kw), files, cold
                )
                res.setdefault("bytes_on_disk", {})[name] = du(run)
                shutil.rmtree(run)
            for k in [k for k in row if k.endswith("_s")]:
                row[k[:-2] + "_GBps"] = nbytes / row[k] / 1e9
            for k in ["read_phase", *variants]:
                row[f"ratio_{k}"] = row["loader_s"] / row[f"{k}_s"]
            row["disk_bound_s"] = nbytes / (res["disk_write_fsync_GBps"] * 1e9)
            res[mode] = row
        res["bytes_on_disk"]["source"] = du(src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def report(r: dict[str, Any]) -> None:
        gb = r["source_bytes"] / 1e9
        print(
            f"{r['checkpoints']} HF Trainer checkpoints, {gb:.3f} GB; disk write+fsync "
            f"{r['disk_write_fsync_GBps']:.2f} GB/s (writing the source's bytes durably "
            f"takes {r['cold']['disk_bound_s']:.2f} s)"
        )
        for mode in ("cold", "warm"):
            row = r[mode]
            print(f"\n{mode}: {'':24} seconds   GB/s   ratio to the loader")
            for k in ("loader", "read_phase", "import", "import_no_summaries", "import_delta"):
                ratio = "" if k == "loader" else f"{row[f'ratio_{k}']:.2f}"
                print(f"  {k:30} {row[f'{k}_s']:7.2f} {row[f'{k}_GBps']:6.3f}   {ratio}")
        print(
            "\nbytes on disk: "
            + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["bytes_on_disk"].items())
        )

    return finish(res, Path(a.json), t_start, report)


if __name__ == "__main__":
    main()
