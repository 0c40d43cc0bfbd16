"""Torch optimizers back from a step: their state dicts, and which live optimizer is which.

The engine writes ``optim/param_groups`` and ``optim/state`` per optimizer (suffixed
``/<key>`` for a session given several: ``"0"``, ``"1"``... or a dict's keys).
:func:`stored_keys` finds a step's keys, :func:`live_optimizers` pairs the optimizers given to
``load_into`` with them (same count and keys, else a ``SchemaError`` saying what the step
holds) and :func:`check_optimizer` checks one against its stored groups before any load.

Rejected alternative: pairing several optimizers by the parameters they hold — a dict's keys
are the session's own names for them, and an error naming keys is clearer than one naming
parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dstt.engine.state.model_names import param_names
from dstt.errors import SchemaError
from dstt.schema import OPTIM_GROUPS_OBJECT, canonical_name, tensor_path

from .naming import listed

__all__ = [
    "canonical_groups",
    "check_optimizer",
    "live_optimizers",
    "optimizer_state",
    "stored_keys",
]


def stored_keys(objects: Iterable[str]) -> list[str]:
    """The optimizer keys of a step's objects: ``[""]`` for one optimizer, the session's
    keys for several (numbers in numeric order), ``[]`` for none."""
    names = set(objects)
    if OPTIM_GROUPS_OBJECT in names:
        return [""]
    keys = [
        n[len(OPTIM_GROUPS_OBJECT) + 1 :] for n in names if n.startswith(OPTIM_GROUPS_OBJECT + "/")
    ]
    return sorted(keys, key=lambda k: (not k.isdigit(), int(k) if k.isdigit() else 0, k))


def canonical_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored param groups with parameter names without wrapper components (a run captured
    before capture dropped them names ``_orig_mod.l1.weight``)."""
    return [{**g, "params": [canonical_name(n) for n in g["params"]]} for g in groups]


def optimizer_state(src: Any, groups: list[dict[str, Any]], state_object: str) -> dict[str, Any]:
    """torch's optimizer state dict from the stored groups (:func:`canonical_groups`) and
    per-parameter state (``src``: the step, giving ``tensor(path)``, ``object(name)`` and
    ``step``)."""
    names = [n for g in groups for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    saved = src.object(state_object) or {}
    entries: Mapping[str, Any] = {canonical_name(n): e for n, e in saved.get("params", {}).items()}
    unknown = set(entries) - set(index)
    if unknown:
        raise SchemaError(
            f"step {src.step} has optimizer state for parameters in no param "
            f"group: {listed(sorted(unknown), 8)}; the run is damaged (run "
            "`dstt verify`)"
        )
    state: dict[int, dict[str, Any]] = {}
    for name in names:
        entry = entries.get(name)
        if entry is None:
            continue
        st = {key: src.tensor(tensor_path(f"optim/{key}", name)) for key in entry["arrays"]}
        st.update(entry["values"])
        state[index[name]] = st
    ids = iter(range(len(names)))  # torch numbers the parameters across the groups
    param_groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [next(ids) for _ in g["params"]],
        }
        for g in groups
    ]
    return {"state": state, "param_groups": param_groups}


def _named(keys: Iterable[str]) -> str:
    return ", ".join(repr(k) for k in keys)


def live_optimizers(optimizer: Any, keys: list[str], step: int) -> dict[str, torch.optim.Optimizer]:
    """The optimizers given to ``load_into`` by the step's optimizer ``keys``."""
    if not keys:
        raise SchemaError(
            f"step {step} holds no torch optimizer state (the run was written "
            "without one, or by DeepSpeed); load the model only"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        given: dict[str, Any] = {"": optimizer}
    elif isinstance(optimizer, Mapping):
        given = {str(k): v for k, v in optimizer.items()}
    elif isinstance(optimizer, list | tuple):
        given = {str(i): v for i, v in enumerate(optimizer)}
    else:
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, a list of them or a dict "
            f"of them, not {type(optimizer).__name__}"
        )
    if keys == [""] and len(given) == 1:  # a list or dict of one is captured as one
        return {"": next(iter(given.values()))}
    if keys == [""]:
        raise SchemaError(
            f"step {step} holds one optimizer, {len(given)} were given; pass "
            "the one the session captured"
        )
    if "" in given:
        raise SchemaError(
            f"step {step} holds {len(keys)} optimizers ({_named(keys)}): pass "
            "them as the session was given them, a dict with those keys (or a "
            "list, for '0', '1', ...)"
        )
    if set(given) != set(keys):
        what = "a list of" if all(k.isdigit() for k in given) else "optimizers"
        raise SchemaError(
            f"step {step} holds the optimizers {_named(keys)}; given {what} "
            f"{_named(given)} — pass the same number, under the same keys"
        )
    return {k: given[k] for k in keys}


def check_optimizer(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    model: torch.nn.Module | None,
    step: int,
    key: str = "",
) -> None:
    """``SchemaError`` unless ``optimizer`` holds the stored ``groups``' parameters."""
    which = f"optimizer {key!r}: " if key else ""
    live = optimizer.param_groups
    if len(groups) != len(live):
        raise SchemaError(
            f"{which}step {step} has {len(groups)} optimizer param groups, the "
            f"live optimizer has {len(live)}; build the optimizer as the run did"
        )
    names = param_names(model) if model is not None else {}
    for gi, (g, saved) in enumerate(zip(live, groups, strict=True)):
        if len(g["params"]) != len(saved["params"]):
            raise SchemaError(
                f"{which}param group {gi} holds {len(g['params'])} parameters, "
                f"the one of step {step} {len(saved['params'])}; build the "
                "optimizer as the run did"
            )
        if model is not None:
            have = [
                names.get(id(p), f"unnamed.group{gi}.param{pi}") for pi, p in enumerate(g["params"])
            ]
            if have != list(saved["params"]):
                diff = [f"{a} != {b}" for a, b in zip(have, saved["params"], strict=True) if a != b]
                raise SchemaError(
                    f"{which}param group {gi} holds other parameters (or "
                    f"another order) than at step {step}: {listed(diff, 8)}"
                )
