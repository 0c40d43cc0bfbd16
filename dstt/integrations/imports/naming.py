"""Naming an optimizer state keyed by index: which parameter is ``state[7]``?

``optimizer.state_dict()`` numbers parameters by position in its param groups; the names are
not in the file. They come from the model's parameter order (``model=``, else the source's
architecture on the meta device, else its own state dict's order) and the grouping rule: one
group in model order; two groups of a Hugging Face model by the Trainer's decay rule;
otherwise consecutive runs when the group sizes say so. Every assignment is checked against
the state tensors' shapes (a mismatch is a :class:`~dstt.errors.SourceError` asking for
``model=``). Not knowable: a hand-picked parameter order hidden by equal shapes.

Rejected alternative: naming by order without the shape check — a source whose groups were
built in another order would be misnamed silently. Details: docs/decisions.md.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from itertools import islice
from typing import Any

import torch

from dstt.errors import SourceError

__all__ = ["group_names", "hf_decay_names", "hf_meta_model", "trainable_names"]


def trainable_names(model: torch.nn.Module) -> list[str]:
    """``named_parameters()`` order of the parameters that train (tied ones once)."""
    from dstt.engine.state.model_names import canonical_names

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    canon = canonical_names(model, [n for n, _ in named])
    return [canon[n] for n, _ in named]


def hf_meta_model(folder: str) -> torch.nn.Module | None:
    """The architecture of a Hugging Face checkpoint folder (``config.json``), built on the
    meta device; None when transformers cannot build it (unknown or remote code). Built once
    per distinct ``config.json`` (a run's checkpoints share one)."""
    import os

    config = os.path.join(folder, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config, "rb") as fh:
        text = fh.read()
    if text not in _BUILT:
        if len(_BUILT) >= 4:
            _BUILT.clear()
        _BUILT[text] = _meta_model(folder)
    return _BUILT[text]


_BUILT: dict[bytes, torch.nn.Module | None] = {}  # config.json text -> its meta model


def _meta_model(folder: str) -> torch.nn.Module | None:
    try:
        import transformers

        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
        archs = getattr(config, "architectures", None) or []
        cls = getattr(transformers, archs[0], None) if archs else None
        if cls is None:
            return None
        with torch.device("meta"):
            model = cls(config)
        return model if isinstance(model, torch.nn.Module) else None
    except Exception:  # any failure means "not buildable here": name otherwise
        return None


def hf_decay_names(model: torch.nn.Module) -> set[str] | None:
    """The Trainer's decay parameters (its own rule, ``get_decay_parameter_names``), or None
    when transformers is not installed."""
    try:
        from transformers import Trainer
    except ImportError:
        return None
    # the method reads only the model (transformers 4.x-5.x); it is the Trainer's own rule
    return set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]


def _misfit(
    groups: Sequence[Sequence[str]],
    ids: Sequence[Sequence[Any]],
    state: Mapping[Any, Any],
    shapes: Mapping[str, tuple[int, ...]],
) -> str | None:
    """None when every state tensor (ndim > 0) of the param groups' ``ids`` has the shape of
    the parameter ``groups`` names it by; else what disagrees."""
    for names, group_ids in zip(groups, ids, strict=True):
        for name, idx in zip(names, group_ids, strict=True):
            want = shapes.get(name)
            for key, v in (state.get(idx) or {}).items():
                if want is None or not isinstance(v, torch.Tensor) or not v.ndim:
                    continue
                if tuple(v.shape) != tuple(want):
                    return (
                        f"state {key!r} of parameter {idx} has shape {tuple(v.shape)}, but "
                        f"{name!r} has {tuple(want)}"
                    )
    return None


def group_names(
    osd: Mapping[str, Any],
    order: Sequence[str],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    where: str,
    decay: Collection[str] | None = None,
) -> list[list[str]]:
    """The names of each param group's parameters (see the module docstring)."""
    groups = osd.get("param_groups")
    if not isinstance(groups, list) or not all(
        isinstance(g, Mapping) and "params" in g for g in groups
    ):
        raise SourceError(
            f"{where}: the optimizer state has no param_groups; is it a torch "
            "optimizer's state_dict()?"
        )
    ids = [list(g["params"]) for g in groups]
    sizes = [len(i) for i in ids]
    state = osd.get("state") or {}
    if all(isinstance(i, str) for g in ids for i in g):  # already named (DCP's FQN layout)
        return ids
    hint = (
        "pass model= (the model, built as in training) so its parameter order names "
        "the optimizer's state, or import the weights alone"
    )
    if sum(sizes) != len(order):
        raise SourceError(
            f"{where}: the optimizer holds {sum(sizes)} parameters but the model "
            f"has {len(order)} trainable ones; {hint}"
        )
    candidates: list[list[list[str]]] = []
    if decay is not None and len(groups) == 2:
        first = [n for n in order if n in decay]
        rest = [n for n in order if n not in decay]
        candidates.append([first, rest])
    runs = iter(order)
    candidates.append([list(islice(runs, n)) for n in sizes])  # consecutive runs in order
    why = "no grouping fits"
    for cand in candidates:
        if [len(c) for c in cand] != sizes:
            continue
        bad = _misfit(cand, ids, state, shapes)
        if bad is None:
            return cand
        why = bad
    raise SourceError(
        f"{where}: cannot tell which parameter each optimizer state belongs to ({why}); {hint}"
    )
