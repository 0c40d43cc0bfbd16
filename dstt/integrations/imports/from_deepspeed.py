"""A DeepSpeed checkpoint tag (``global_step500/``) as a :class:`Checkpoint`: logical fp32
tensors and optimizer state, ZeRO 0-3, any world size.

Files load with ``torch.load(weights_only=True)`` (``loading``). For ZeRO 1-3, DeepSpeed's
own ``zero_to_fp32`` functions are handed the master partitions, then each optimizer state's
partitions in their place, so every logical ``params/<name>`` and ``optim/<state>/<name>``
comes out of DeepSpeed's own reconstruction, padding and alignment included. ZeRO 0 is a
plain model + torch optimizer state. The engine's counters and config go to
``extra/deepspeed``; the step is ``global_steps``; a tag holds no RNG state (``lacks``).

Rejected alternative: DeepSpeed's universal checkpoint conversion (``ds_to_universal``) — a
second copy of the whole checkpoint on disk, one file per tensor, before anything is read.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.errors import SourceError

from .checkpoint import Checkpoint, NamedOptimizer
from .from_torch import model_checkpoint
from .loading import deepspeed_globals, load_pickle

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

__all__ = ["FORMAT", "is_deepspeed_tag", "read_deepspeed"]

FORMAT = "deepspeed"


def _natural(path: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", os.path.basename(path))]


def _files(path: str, kind: str) -> list[str]:
    return sorted(glob.glob(os.path.join(path, f"*_{kind}_states.pt")), key=_natural)


def is_deepspeed_tag(path: str) -> bool:
    return os.path.isdir(path) and bool(_files(path, "model"))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """stdout and stderr muted: ``zero_to_fp32`` prints and draws a progress bar per call."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _merge(
    z: Any, stage: int, world: int, flats: list[Any], models: list[Any], paddings: Any
) -> dict[str, torch.Tensor]:
    """DeepSpeed's reconstruction of logical tensors from per-rank flat partitions."""
    # zero_to_fp32's own reconstruction, private there: the module docstring says why we
    # call it (it is handed each optimizer state's partitions as well as the masters')
    with _quiet():
        if stage <= 2:
            sd = z._get_fp32_state_dict_from_zero2_checkpoint(  # noqa: SLF001
                world, flats, models, False, paddings
            )
        else:
            sd = z._get_fp32_state_dict_from_zero3_checkpoint(  # noqa: SLF001
                world, flats, models, False
            )
        return dict(z.to_torch_tensor(sd))


def read_deepspeed(
    path: str,
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    trusted: bool = False,
) -> Checkpoint:
    """Read one DeepSpeed checkpoint tag folder (see the module docstring)."""
    model_files, optim_files = _files(path, "model"), _files(path, "optim")
    if not model_files:
        raise SourceError(f"{path} holds no DeepSpeed *_model_states.pt file")
    allow = deepspeed_globals()
    states = [load_pickle(f, trusted=trusted, allow=allow) for f in model_files]
    first = states[0]
    if not isinstance(first, Mapping) or "module" not in first:
        raise SourceError(f"{model_files[0]} is not a DeepSpeed model state file")
    k = step if step is not None else first.get("global_steps")
    if not isinstance(k, int):
        raise SourceError(f"{path}: no global_steps in {model_files[0]}; pass step=/--step")
    files = {f: os.path.getsize(f) for f in [*model_files, *optim_files]}
    extra = {
        n: first.get(n)
        for n in (
            "global_steps",
            "global_samples",
            "skipped_steps",
            "dp_world_size",
            "ds_config",
            "ds_version",
        )
    }
    if not optim_files:  # ZeRO 0: the torch optimizer's state sits in the model file
        ck = model_checkpoint(
            first["module"],
            first.get("optimizer"),
            step=k,
            source=os.path.abspath(path),
            fmt=FORMAT,
            model=model,
        )
        extra["zero_stage"] = 0
    else:
        ck = _zero(path, first, states, optim_files, trusted, allow, k, model)
        extra["zero_stage"] = ck.objects.pop("_stage")
    ck.scheduler = first.get("lr_scheduler")
    ck.objects[f"{schema.EXTRA_OBJECT}/deepspeed"] = extra
    ck.files = files
    ck.note_lacks()
    return ck


def _zero(
    path: str,
    first: Mapping[str, Any],
    states: list[Any],
    optim_files: list[str],
    trusted: bool,
    allow: list[Any],
    k: int,
    model: torch.nn.Module | None,
) -> Checkpoint:
    from deepspeed.utils import zero_to_fp32 as z

    optims = [
        load_pickle(f, trusted=trusted, allow=allow)["optimizer_state_dict"] for f in optim_files
    ]
    o0 = optims[0]
    stage = int(o0["zero_stage"])
    world = o0["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optims):
        raise SourceError(
            f"{path} holds {len(optims)} optimizer files but was saved by "
            f"{world} ranks; is the checkpoint complete?"
        )
    buffer_names = set(first.get("buffer_names") or [])
    models = [
        z.zero_model_state(
            buffers={n: t for n, t in s["module"].items() if n in buffer_names},
            param_shapes=s["param_shapes"],
            shared_params=[[a, b] for a, b in (s.get("shared_params") or {}).items()],
            ds_version=s.get("ds_version"),
            frozen_param_shapes=s.get("frozen_param_shapes"),
            frozen_param_fragments=s.get("frozen_param_fragments"),
        )
        for s in states
    ]
    key = "single_partition_of_fp32_groups" if stage <= 2 else "fp32_flat_groups"
    paddings = o0.get("param_alignment_paddings")
    full = _merge(z, stage, world, [o[key] for o in optims], models, paddings)
    trainable = [n for shapes in first["param_shapes"] for n in shapes]
    params = {n: full[n] for n in trainable}
    buffers = {n: t for n, t in full.items() if n not in params and n in buffer_names}
    frozen = {n: t for n, t in full.items() if n not in params and n not in buffers}
    ck = Checkpoint(
        step=k,
        source=os.path.abspath(path),
        format=FORMAT,
        params={**params, **frozen},
        buffers=buffers,
        model=model,
    )
    inner = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    base = [o[inner] for o in optims]
    groups0 = base[0]["state"]
    state: dict[str, dict[str, Any]] = {n: {} for n in trainable}
    for skey in sorted({s for g in groups0.values() for s in g}):
        per_rank = [[b["state"][g][skey] for g in sorted(b["state"])] for b in base]
        if all(t.ndim == 0 for t in per_rank[0]):  # a counter per group: each parameter's
            steps = {float(t) for t in per_rank[0]}
            if len(steps) != 1:
                raise SourceError(
                    f"{path}: optimizer groups disagree on {skey!r} "
                    f"({sorted(steps)}); import the weights alone"
                )
            for n in trainable:
                state[n][skey] = per_rank[0][0].clone()
            continue
        flats = per_rank if stage <= 2 else [list(r) for r in per_rank]
        merged = _merge(z, stage, world, flats, models, paddings)
        for n in trainable:
            state[n][skey] = merged[n]
    groups = base[0]["param_groups"]
    shapes = first["param_shapes"]
    if len(groups) != len(shapes):
        raise SourceError(
            f"{path}: {len(groups)} optimizer groups but {len(shapes)} groups "
            "of parameter shapes; import the weights alone"
        )
    ck.optimizer = NamedOptimizer.named(groups, [list(s) for s in shapes], state)
    ck.objects["_stage"] = stage
    return ck
