"""A Hugging Face ``Trainer`` checkpoint folder (``checkpoint-500/``) as a :class:`Checkpoint`.

Each file is read with its own reader: the weights (safetensors or ``pytorch_model.bin``,
sharded or not), ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``,
``trainer_state.json`` (step, progress, ``log_history``) and ``config.json`` (the architecture
on the meta device, to name the optimizer's parameters: ``naming``). A resume's needs are
stored as ``DsttCallback`` stores them, so ``DsttCallback(run, resume=True)`` continues an
imported step exactly as ``resume_from_checkpoint="checkpoint-500"`` would.

Rejected alternative: copying the folder's files into the run as opaque objects — the
tensors would be invisible to every view, and a resume would need the Trainer's own loader.
"""

from __future__ import annotations

import glob
import json
import os
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.errors import SourceError
from dstt.integrations._common import PROGRESS_FIELDS

from .checkpoint import Checkpoint, NamedOptimizer, rng_object, split_by_model
from .loading import load_pickle, read_safetensors
from .naming import group_names, hf_decay_names, hf_meta_model, trainable_names

if TYPE_CHECKING:
    import torch

__all__ = ["FORMAT", "is_hf_folder", "read_hf", "step_of_hf"]

FORMAT = "hf-trainer"
WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def is_hf_folder(path: str) -> bool:
    return os.path.isdir(path) and (
        os.path.isfile(os.path.join(path, "trainer_state.json"))
        or (
            os.path.isfile(os.path.join(path, "optimizer.pt"))
            and any(os.path.isfile(os.path.join(path, w)) for w in WEIGHTS)
        )
    )


def _trainer_state(path: str) -> dict[str, Any]:
    f = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(f):
        return {}
    try:
        with open(f, encoding="utf-8") as fh:
            out = json.load(fh)
    except (OSError, ValueError) as e:
        raise SourceError(f"{f} cannot be read ({e}); is the checkpoint complete?") from None
    if not isinstance(out, dict):
        raise SourceError(f"{f} is not a Trainer state (a JSON object)")
    return out


def step_of_hf(path: str) -> int | None:
    """``global_step`` of ``trainer_state.json`` (None when the folder has none)."""
    step = _trainer_state(path).get("global_step")
    return int(step) if isinstance(step, int) else None


def _weights(path: str) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """(tensors, files, whether their order is the model's state_dict order)."""

    def shards(index: str) -> list[str]:
        with open(os.path.join(path, index), encoding="utf-8") as fh:
            files = dict.fromkeys(json.load(fh)["weight_map"].values())
        return [os.path.join(path, f) for f in files]

    join = os.path.join
    if os.path.isfile(join(path, "model.safetensors")):
        files = [join(path, "model.safetensors")]
        return read_safetensors(files), files, False
    if os.path.isfile(join(path, "model.safetensors.index.json")):
        files = shards("model.safetensors.index.json")
        return read_safetensors(files), files, False
    if os.path.isfile(join(path, "pytorch_model.bin.index.json")):
        files = shards("pytorch_model.bin.index.json")
    elif os.path.isfile(join(path, "pytorch_model.bin")):
        files = [join(path, "pytorch_model.bin")]
    else:
        raise SourceError(
            f"{path} holds no model weights (none of {', '.join(WEIGHTS)}); "
            "is the checkpoint complete?"
        )
    out: dict[str, torch.Tensor] = {}
    for f in files:
        sd = load_pickle(f)
        if not isinstance(sd, dict):
            raise SourceError(f"{f} is not a state dict")
        out.update(sd)
    return out, files, True


def _metrics(
    state: dict[str, Any], step: int
) -> tuple[dict[str, Any], list[tuple[int, dict[str, Any]]]]:
    """``log_history`` split into this step's values and those of earlier steps."""
    by_step: dict[int, dict[str, Any]] = {}
    for entry in state.get("log_history") or []:
        k = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(k, int) or k > step:
            continue
        values = {
            n: v
            for n, v in entry.items()
            if n != "step" and isinstance(v, bool | int | float | str)
        }
        by_step.setdefault(k, {}).update(values)
    own = by_step.pop(step, {})
    return own, sorted(by_step.items())


def read_hf(
    path: str,
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    trusted: bool = False,
) -> Checkpoint:
    """Read one Trainer checkpoint folder (see the module docstring)."""
    state = _trainer_state(path)
    k = step if step is not None else state.get("global_step")
    if not isinstance(k, int):
        raise SourceError(f"{path} has no trainer_state.json global_step; pass step=/--step")
    tensors, files, ordered = _weights(path)
    arch = model if model is not None else hf_meta_model(path)
    params, buffers, tied = split_by_model(tensors, arch, where=path)
    ck = Checkpoint(
        step=k,
        source=os.path.abspath(path),
        format=FORMAT,
        params=params,
        buffers=buffers,
        model=arch,
    )
    ck.files = {f: os.path.getsize(f) for f in files}
    ck.metrics, ck.history = _metrics(state, k)
    opt_file = os.path.join(path, "optimizer.pt")
    if os.path.isfile(opt_file):
        osd = load_pickle(opt_file, trusted=trusted)
        ck.files[opt_file] = os.path.getsize(opt_file)
        if arch is not None:
            order, decay = trainable_names(arch), hf_decay_names(arch)
        elif ordered:
            order, decay = list(params), None
        else:
            raise SourceError(
                f"{path}: cannot name the optimizer's parameters: transformers cannot build "
                "the model from config.json and safetensors does not keep the parameter "
                "order; pass model= (the model, built as in training)"
            )
        shapes = {n: tuple(t.shape) for n, t in {**params, **buffers}.items()}
        names = group_names(osd, order, shapes, where=opt_file, decay=decay)
        ck.optimizer = NamedOptimizer.of(osd, names)
    sched = os.path.join(path, "scheduler.pt")
    if os.path.isfile(sched):
        ck.scheduler = load_pickle(sched, trusted=trusted)
        ck.files[sched] = os.path.getsize(sched)
    single = os.path.join(path, "rng_state.pth")
    per_rank = sorted(glob.glob(os.path.join(path, "rng_state_*.pth")))
    for f in [single] if os.path.isfile(single) else per_rank:
        name = (
            schema.RNG_OBJECT
            if f == single
            else f"{schema.RNG_OBJECT}/r{int(f.rsplit('_', 1)[1].split('.')[0])}"
        )
        ck.rng[name] = rng_object(load_pickle(f, trusted=trusted), f)
        ck.files[f] = os.path.getsize(f)
    progress = {n: state.get(n) for n in PROGRESS_FIELDS}
    progress["global_step"] = k
    ck.objects[f"{schema.EXTRA_OBJECT}/transformers"] = progress
    if tied:
        ck.objects[schema.TIED_OBJECT] = tied
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as fh:
            ck.objects[schema.CONFIG_OBJECT] = json.load(fh)
    ck.note_lacks()
    return ck
