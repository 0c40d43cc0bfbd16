"""A committed step back in torch's own formats: ``state_dict()`` and ``load_into``.

``step_state(reader, header)`` returns ``{"model": ..., "optimizer": ..., "scheduler": ...}``
as ``model.state_dict()``, ``optimizer.state_dict()`` and ``scheduler.state_dict()`` would have
given them: model tensors by dotted name in their stored dtypes (bf16 stays bf16, bit for bit),
and the optimizer as ``{"state": {index: {...}}, "param_groups": [{..., "params": [index]}]}``
with parameters numbered by their position in the stored groups, as torch numbers them.
``load_step`` checks the live objects against the step (names, dtypes, shapes, param groups)
*before* touching any of them, then loads through torch's own ``load_state_dict``.

Time: tensors as right after optimizer step *k*; optimizer hyperparameters and the scheduler
as at the end of iteration *k* (after the loop's ``scheduler.step()``) — exactly what
``resume=True`` restores (see :mod:`dstt.engine.torch_state`), so loading step *k* and
training on gives the original run's step *k + 1*.

Design choice: the bytes become tensors through the engine's own conversions
(:mod:`dstt.engine._convert`: raw bytes reinterpreted, tagged tensors inside objects), the
same code resume uses, so this is the one place in ``dstt.inspect`` that imports the engine
(and torch); ``dstt._snapshot`` imports this module only when it is used. The optimizer is rebuilt
from the two objects the engine writes for a torch optimizer — ``optim/param_groups``
(hyperparameters and parameter names per group) and ``optim/state`` (which keys of each
parameter's state are arrays ``optim/<key>/<name>``, and the values of the others).
Rejected alternative: driving the engine's providers against live objects (what resume does)
— ``state_dict()`` must work without live objects, and two rebuilds would drift apart.

Limits: a tied parameter is stored once, under its first name, so ``state_dict()`` lists it
once; ``load_step`` fills the other names from the live model. A run written without a torch
optimizer (DeepSpeed's ZeRO partitions, ``dstt.store.save``) has ``"optimizer": None``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch

from ..engine._convert import from_plain, tensor_from_numpy
from ..engine.torch_state import param_names
from ..errors import SchemaError
from ..schema import MODEL_KINDS, tensor_path, user_name

__all__ = ["GROUPS_OBJECT", "PARTS", "SCHEDULER_OBJECT", "STATE_OBJECT", "LoadResult",
           "load_step", "step_state"]

GROUPS_OBJECT = "optim/param_groups"  # the engine's names (dstt.engine.torch_state)
STATE_OBJECT = "optim/state"
SCHEDULER_OBJECT = "scheduler"
PARTS = ("model", "optimizer", "scheduler")
_SHOW = 8  # names listed in an error message


class LoadResult(NamedTuple):
    """What ``load_into`` left out (non-empty only with ``strict=False``), like torch's."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


class _Step:
    """One commit read through a store reader, as tensors and decoded objects."""

    def __init__(self, reader: Any, header: Any, trusted: bool) -> None:
        self.reader, self.header, self.trusted = reader, header, trusted
        self.step = int(header.step)
        self.table = reader.arrays(header)

    def tensor(self, path: str) -> torch.Tensor:
        if path not in self.table:
            raise SchemaError(f"step {self.step} has no array {path!r}, which its optimizer "
                              "state names; the run is damaged (run `dstt verify`)")
        return tensor_from_numpy(self.reader.read_array(self.header, path),
                                 self.table[path].dtype)

    def object(self, name: str) -> Any:
        if name not in self.header.objects:
            return None
        return from_plain(self.reader.read_object(self.header, name, trusted=self.trusted))

    def model_paths(self, order: list[str]) -> list[str]:
        """Model arrays in ``state_dict`` order as far as it can be told: modules in the
        order of ``order`` (the optimizer's parameter names), then in stored order; within a
        module its parameters (in ``order``), then its buffers."""
        paths = [p for p in self.table if p.split("/")[0] in MODEL_KINDS]
        pos = {n: i for i, n in enumerate(order)}
        modules: dict[str, int] = {}
        for name in [*order, *map(user_name, paths)]:
            modules.setdefault(name.rpartition(".")[0], len(modules))

        def key(ip: tuple[int, str]) -> tuple[int, int, int]:
            i, p = ip
            name = user_name(p)
            buffer = p.startswith("buffers/")
            return (modules[name.rpartition(".")[0]], int(buffer),
                    i if buffer else pos.get(name, len(pos) + i))

        return [p for _, p in sorted(enumerate(paths), key=key)]


def _optimizer(src: _Step, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's optimizer state dict from the stored groups and per-parameter state."""
    names = [n for g in groups for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    saved = src.object(STATE_OBJECT) or {}
    entries: Mapping[str, Any] = saved.get("params", {})
    unknown = set(entries) - set(index)
    if unknown:
        raise SchemaError(f"step {src.step} has optimizer state for parameters in no param "
                          f"group: {_listed(unknown)}; the run is damaged (run `dstt verify`)")
    state: dict[int, dict[str, Any]] = {}
    for name in names:
        entry = entries.get(name)
        if entry is None:
            continue
        st = {key: src.tensor(tensor_path(f"optim/{key}", name)) for key in entry["arrays"]}
        st.update(entry["values"])
        state[index[name]] = st
    param_groups, start = [], 0
    for g in groups:
        n = len(g["params"])
        param_groups.append({**{k: v for k, v in g.items() if k != "params"},
                             "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": param_groups}


def step_state(reader: Any, header: Any, *, parts: Iterable[str] = PARTS,
               trusted: bool = False) -> dict[str, Any]:
    """``{"model", "optimizer", "scheduler"}`` of one commit in torch's formats (see the
    module docstring); a part not captured is None, a part not in ``parts`` is not read."""
    return _read(reader, header, parts, trusted)[0]


def _read(reader: Any, header: Any, parts: Iterable[str], trusted: bool
          ) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
    """``step_state`` and the stored param groups (with parameter names)."""
    want = set(parts)
    if want - set(PARTS):
        raise ValueError(f"unknown parts {sorted(want - set(PARTS))}; use {', '.join(PARTS)}")
    src = _Step(reader, header, trusted)
    groups = src.object(GROUPS_OBJECT) if want & {"model", "optimizer"} else None
    out: dict[str, Any] = {}
    if "model" in want:
        order = [n for g in groups or () for n in g["params"]]
        out["model"] = {user_name(p): src.tensor(p) for p in src.model_paths(order)}
    if "optimizer" in want:
        out["optimizer"] = None if groups is None else _optimizer(src, groups)
    if "scheduler" in want:
        out["scheduler"] = src.object(SCHEDULER_OBJECT)
    return out, groups


# -- loading into live objects -------------------------------------------------------------

def _model_state(model: torch.nn.Module, stored: dict[str, torch.Tensor], step: int,
                 strict: bool) -> tuple[dict[str, torch.Tensor], LoadResult]:
    """``stored`` with the live model's tied names filled in, checked against the model."""
    live = model.state_dict(keep_vars=True)
    by_id: dict[int, str] = {}
    for name, t in live.items():
        if name in stored:
            by_id.setdefault(id(t), name)
    out = dict(stored)
    for name, t in live.items():
        if name not in out and id(t) in by_id:  # a tied name: stored once, under another
            out[name] = out[by_id[id(t)]]
    missing = [n for n in live if n not in out]
    unexpected = [n for n in out if n not in live]
    if strict and (missing or unexpected):
        raise SchemaError(
            f"step {step} does not fit the model: "
            + "; ".join(s for s in (
                f"missing from the step: {_listed(missing)}" if missing else "",
                f"in the step but not in the model: {_listed(unexpected)}" if unexpected
                else "") if s)
            + ". Was the run written by a different model? load_into(..., strict=False) "
            "loads the tensors both have")
    wrong = [f"{n} (stored {out[n].dtype}{tuple(out[n].shape)}, model "
             f"{t.dtype}{tuple(t.shape)})" for n, t in live.items()
             if n in out and (out[n].dtype != t.dtype or out[n].shape != t.shape)]
    if wrong:
        raise SchemaError(f"step {step}: tensors differ from the model's in dtype or shape "
                          f"(loading would not be exact): {_listed(wrong)}")
    return ({n: v for n, v in out.items() if n in live},
            LoadResult(missing, unexpected))


def _check_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]],
                     model: torch.nn.Module | None, step: int) -> None:
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise SchemaError(f"step {step} has {len(groups)} optimizer param groups, the live "
                          f"optimizer has {len(live)}; build the optimizer as the run did")
    names = param_names(model) if model is not None else {}
    for gi, (g, saved) in enumerate(zip(live, groups, strict=True)):
        if len(g["params"]) != len(saved["params"]):
            raise SchemaError(f"param group {gi} holds {len(g['params'])} parameters, the one "
                              f"of step {step} {len(saved['params'])}; build the optimizer as "
                              "the run did")
        if model is not None:
            have = [names.get(id(p), f"unnamed.group{gi}.param{pi}")
                    for pi, p in enumerate(g["params"])]
            if have != list(saved["params"]):
                diff = [f"{a} != {b}" for a, b in zip(have, saved["params"], strict=True)
                        if a != b]
                raise SchemaError(f"param group {gi} holds other parameters (or another "
                                  f"order) than at step {step}: {_listed(diff)}")


def load_step(reader: Any, header: Any, model: torch.nn.Module | None = None,
              optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, *,
              strict: bool = True, trusted: bool = False) -> LoadResult:
    """Load one commit into live objects (any of them may be None); everything is read and
    checked first, so a mismatch or a damaged step leaves every live object untouched."""
    parts = [p for p, obj in zip(PARTS, (model, optimizer, scheduler), strict=True)
             if obj is not None]
    if not parts:
        raise TypeError("load_into needs a model, an optimizer or a scheduler to load into")
    step = int(header.step)
    sd, groups = _read(reader, header, parts, trusted)
    result = LoadResult([], [])
    if model is not None:
        msd, result = _model_state(model, sd["model"], step, strict)
    if optimizer is not None:
        if groups is None:
            raise SchemaError(f"step {step} holds no torch optimizer state (the run was "
                              "written without one, or by DeepSpeed); load the model only")
        _check_optimizer(optimizer, groups, model, step)
    if scheduler is not None and sd["scheduler"] is None:
        raise SchemaError(f"step {step} holds no scheduler state (the session was not given "
                          "scheduler=); leave the scheduler out")
    if model is not None:
        model.load_state_dict(msd, strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(sd["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(sd["scheduler"])
    return result
