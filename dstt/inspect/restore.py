"""A committed step back in torch's own formats: ``state_dict()`` and ``load_into``.

``step_state`` returns ``{"model", "optimizer", "scheduler"}`` as torch's ``state_dict()``
calls would (stored dtypes bit for bit, tied parameters under each name; several optimizers
as a dict by the session's keys; ``"optimizer": None`` without a torch optimizer).
``load_step`` checks the live objects against the step before touching any, then loads
through ``load_state_dict``; loading step *k* and training on gives the run's step *k + 1*.
Bytes become tensors through the engine's own conversions (the code resume uses), so this
module and :mod:`dstt.inspect.optimizers` are the inspect modules that import torch.

Rejected alternative: driving the engine's providers against live objects (what resume does)
— ``state_dict()`` must work without live objects, and two rebuilds would drift apart.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from dstt.engine.state.model_names import canonical_names
from dstt.engine.tensors._convert import from_plain, tensor_from_numpy
from dstt.engine.tensors.dtensors import as_dtensor_like, held_box, is_dtensor
from dstt.errors import DsttWarning, SchemaError
from dstt.schema import (
    MODEL_KINDS,
    OPTIM_GROUPS_OBJECT,
    OPTIM_STATE_OBJECT,
    SCHEDULER_OBJECT,
    user_name,
)

from .catalog import Catalog
from .naming import canonical_path, listed
from .optimizers import (
    canonical_groups,
    check_optimizer,
    live_optimizers,
    optimizer_state,
    stored_keys,
)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dstt.store._internal import CommitHeader, Reader

__all__ = [
    "PARTS",
    "LoadResult",
    "load_step",
    "step_state",
]

PARTS = ("model", "optimizer", "scheduler")


class _Keys(NamedTuple):
    missing_keys: list[str]
    unexpected_keys: list[str]


class LoadResult(_Keys):
    """What ``load_into`` left out (non-empty only with ``strict=False``), like torch's
    ``(missing_keys, unexpected_keys)``, and ``loaded_keys``: the model's names it loaded."""

    loaded_keys: list[str]

    def __new__(
        cls, missing_keys: list[str], unexpected_keys: list[str], loaded_keys: Iterable[str] = ()
    ) -> LoadResult:
        self = super().__new__(cls, missing_keys, unexpected_keys)
        self.loaded_keys = list(loaded_keys)
        return self

    def __repr__(self) -> str:
        return (
            f"LoadResult(missing_keys={self.missing_keys!r}, unexpected_keys="
            f"{self.unexpected_keys!r}, loaded_keys={listed(self.loaded_keys)!r})"
        )


class _Step:
    """One commit read through a store reader, as tensors and decoded objects."""

    def __init__(self, reader: Reader, header: CommitHeader, trusted: bool) -> None:
        self.reader, self.header, self.trusted = reader, header, trusted
        self.step = int(header.step)
        self.catalog = Catalog.of(reader, header)
        self.table = self.catalog.table

    def tensor(self, path: str) -> torch.Tensor:
        path = canonical_path(path)  # optimizer state names of runs stored with wrappers
        if path not in self.table:
            raise SchemaError(
                f"step {self.step} has no array {path!r}, which its optimizer "
                "state names; the run is damaged (run `dstt verify`)"
            )
        return tensor_from_numpy(
            self.reader.read_array(self.header, self.table[path].path), self.table[path].dtype
        )

    def object(self, name: str) -> Any:
        if name not in self.header.objects:
            return None
        return from_plain(self.reader.read_object(self.header, name, trusted=self.trusted))

    def model_paths(self, order: list[str]) -> list[str]:
        """Model arrays (tied names included) in ``state_dict`` order as far as it can be
        told: modules in the order of ``order`` (the optimizers' parameter names), then in
        stored order; within a module its parameters (in ``order``), then its buffers."""
        paths = [p for p in self.table if p.split("/")[0] in MODEL_KINDS]
        pos = {n: i for i, n in enumerate(order)}
        modules: dict[str, int] = {}
        for name in [*order, *map(user_name, paths)]:
            modules.setdefault(name.rpartition(".")[0], len(modules))

        def key(ip: tuple[int, str]) -> tuple[int, int, int]:
            i, p = ip
            name = user_name(p)
            buffer = p.startswith("buffers/")
            return (
                modules[name.rpartition(".")[0]],
                int(buffer),
                i if buffer else pos.get(name, len(pos) + i),
            )

        return [p for _, p in sorted(enumerate(paths), key=key)]


def step_state(
    reader: Reader, header: CommitHeader, *, parts: Iterable[str] = PARTS, trusted: bool = False
) -> dict[str, Any]:
    """``{"model", "optimizer", "scheduler"}`` of one commit in torch's formats (see the
    module docstring); a part not captured is None, a part not in ``parts`` is not read."""
    return _read(reader, header, parts, trusted)[0]


def _read(
    reader: Reader, header: CommitHeader, parts: Iterable[str], trusted: bool
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """``step_state`` and the stored param groups (with parameter names) by optimizer key
    (``""``: the only one)."""
    want = set(parts)
    if want - set(PARTS):
        raise ValueError(f"unknown parts {sorted(want - set(PARTS))}; use {', '.join(PARTS)}")
    src = _Step(reader, header, trusted)
    groups: dict[str, list[dict[str, Any]]] = {}
    if want & {"model", "optimizer"}:
        for k in stored_keys(header.objects):
            name = f"{OPTIM_GROUPS_OBJECT}/{k}" if k else OPTIM_GROUPS_OBJECT
            groups[k] = canonical_groups(src.object(name))
    out: dict[str, Any] = {}
    if "model" in want:
        order = [n for gs in groups.values() for g in gs for n in g["params"]]
        read: dict[str, torch.Tensor] = {}  # by where the bytes are: a tied tensor once
        out["model"] = {}
        for p in src.model_paths(order):
            where = src.table[p].path
            if where not in read:
                read[where] = src.tensor(p)
            out["model"][user_name(p)] = read[where]
    if "optimizer" in want:
        opts = {
            k: optimizer_state(src, g, f"{OPTIM_STATE_OBJECT}/{k}" if k else OPTIM_STATE_OBJECT)
            for k, g in groups.items()
        }
        out["optimizer"] = opts.get("", opts) if opts else None
    if "scheduler" in want:
        out["scheduler"] = src.object(SCHEDULER_OBJECT)
    return out, groups


# -- loading into live objects -------------------------------------------------------------


def _model_state(
    model: torch.nn.Module, stored: dict[str, torch.Tensor], step: int, strict: bool
) -> tuple[dict[str, torch.Tensor], LoadResult]:
    """``stored`` keyed by the live model's names (wrapper components matched, tied names
    filled in), checked against the model."""
    live = model.state_dict(keep_vars=True)
    canon = canonical_names(model, live)  # live name -> canonical name
    by_id: dict[int, str] = {}
    for name, t in live.items():
        if canon[name] in stored:
            by_id.setdefault(id(t), canon[name])
    out: dict[str, torch.Tensor] = {}
    for name, t in live.items():
        c = canon[name]
        if c in stored:
            out[name] = stored[c]
        elif id(t) in by_id:  # a tied name the run did not list: stored once, under another
            out[name] = stored[by_id[id(t)]]
    missing = [n for n in live if n not in out]
    known = {canon[n] for n in out}
    unexpected = [n for n in stored if n not in known]
    if strict and (missing or unexpected):
        why = [f"missing from the step: {listed(sorted(missing), 8)}"] if missing else []
        if unexpected:
            why.append(f"in the step but not in the model: {listed(sorted(unexpected), 8)}")
        raise SchemaError(
            f"step {step} does not fit the model: {'; '.join(why)}. Was the run written by a "
            "different model? load_into(..., strict=False) loads the tensors both have"
        )
    wrong = [
        f"{n} (stored {out[n].dtype}{tuple(out[n].shape)}, model {t.dtype}{tuple(t.shape)})"
        for n, t in live.items()
        if n in out and (out[n].dtype != t.dtype or out[n].shape != t.shape)
    ]
    if wrong:
        raise SchemaError(
            f"step {step}: tensors differ from the model's in dtype or shape "
            f"(loading would not be exact): {listed(sorted(wrong), 8)}"
        )
    if not out and live:
        warnings.warn(
            f"load_into loaded nothing into the model: none of its {len(live)} names (e.g. "
            f"{next(iter(live))!r}) is stored at step {step} (stored: "
            f"{listed(sorted(stored), 3) or 'no model tensors'}); was the run written by "
            "another model?",
            DsttWarning,
            stacklevel=4,
        )
    return out, LoadResult(missing, unexpected, list(out))


def as_live(value: Any, like: Any) -> Any:
    """A whole stored tensor as the live tensor ``like`` holds it: for a DTensor of the same
    global shape (FSDP2, tensor parallel), a DTensor of its placements whose local tensor is
    this rank's box of ``value`` (sliced, no collective); anything else as it is."""
    if not (
        isinstance(value, torch.Tensor)
        and is_dtensor(like)
        and tuple(value.shape) == tuple(like.shape)
    ):
        return value
    box = held_box(like)
    local = (
        value[tuple(slice(o, o + n) for o, n in zip(*box, strict=True))].contiguous()
        if box is not None
        else torch.empty_like(like.to_local(), device="cpu")
    )
    return as_dtensor_like(local, like)


def _optimizer_as_live(sd: dict[str, Any], opt: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state dict with each DTensor parameter's state as DTensors (``as_live``);
    torch numbers the parameters by their position in the param groups."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {
        i: {k: as_live(v, params[i]) if i < len(params) else v for k, v in st.items()}
        for i, st in sd["state"].items()
    }
    return {**sd, "state": state}


def load_step(
    reader: Reader,
    header: CommitHeader,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    scheduler: Any = None,
    *,
    strict: bool = True,
    trusted: bool = False,
) -> LoadResult:
    """Load one commit into live objects (any of them may be None; ``optimizer`` one, a list
    or a dict of them, as the session was given); everything is read and checked first, so a
    mismatch or a damaged step leaves every live object untouched."""
    parts = [
        p for p, obj in zip(PARTS, (model, optimizer, scheduler), strict=True) if obj is not None
    ]
    if not parts:
        raise TypeError("load_into needs a model, an optimizer or a scheduler to load into")
    step = int(header.step)
    sd, groups = _read(reader, header, parts, trusted)
    result = LoadResult([], [])
    if model is not None:
        msd, result = _model_state(model, sd["model"], step, strict)
    opts = live_optimizers(optimizer, list(groups), step) if optimizer is not None else {}
    for key, opt in opts.items():
        check_optimizer(opt, groups[key], model, step, key)
    if scheduler is not None and sd["scheduler"] is None:
        raise SchemaError(
            f"step {step} holds no scheduler state (the session was not given "
            "scheduler=); leave the scheduler out"
        )
    if model is not None:
        live = model.state_dict(keep_vars=True)
        model.load_state_dict({n: as_live(v, live.get(n)) for n, v in msd.items()}, strict=strict)
    for key, opt in opts.items():
        opt.load_state_dict(
            _optimizer_as_live(sd["optimizer"] if key == "" else sd["optimizer"][key], opt)
        )
    if scheduler is not None:
        scheduler.load_state_dict(sd["scheduler"])
    return result
