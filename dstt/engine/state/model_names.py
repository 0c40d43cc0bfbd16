"""The model's own names: one canonical name per tensor, tied names, and what readers need to
know of the model beyond its tensors.

Torch reports a wrapped model's tensors with the wrappers' components in their names
(``_orig_mod.`` of ``torch.compile``, ``module.`` of DDP, ...); :func:`canonical_names` drops
them with the rule of ``dstt.schema.canonical_name`` (DDP/``DataParallel`` modules are found
here, where torch is at hand). Tied parameters are stored once, under their first name; their
other names go into the object ``names/tied``, a Hugging Face model's config into
``model/config``, and the attention modules' head counts into ``model/heads``
(:class:`ModelInfoProvider`), all taken once per session.
Rejected alternative: naming inside each provider — the model tensors, the optimizer state and
the dims would each need the rule again and could drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dstt.errors import SchemaError
from dstt.schema import CONFIG_OBJECT, HEADS_OBJECT, TIED_OBJECT, canonical_name
from dstt.store._internal import Encoded

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

    from .providers import RestoreSource

__all__ = [
    "HEADS_ATTRIBUTES",
    "ModelInfoProvider",
    "attention_heads",
    "canonical_names",
    "model_config",
    "module_wrappers",
    "param_names",
    "tied_names",
]


def module_wrappers(model: torch.nn.Module) -> frozenset[str]:
    """Paths (as torch names them) of the DDP / ``DataParallel`` modules in ``model``: their
    ``module`` child is a wrapper, not part of the model's names."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return frozenset(
        n for n, m in model.named_modules() if isinstance(m, DistributedDataParallel | DataParallel)
    )


def canonical_names(model: torch.nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Each of ``names`` (as ``model`` reports them) → its canonical name
    (``dstt.schema.canonical_name``); ``SchemaError`` if two land on one name."""
    wrappers = module_wrappers(model)
    out = {n: canonical_name(n, wrappers) for n in names}
    if len(set(out.values())) != len(out):
        seen: dict[str, str] = {}
        for raw, c in out.items():
            if c in seen:
                raise SchemaError(
                    f"tensors {seen[c]!r} and {raw!r} both have the name {c!r} "
                    "once wrapper prefixes are dropped; rename one of them"
                )
            seen[c] = raw
    return out


def param_names(model: torch.nn.Module) -> dict[int, str]:
    """id(parameter) → canonical dotted name (first name wins for tied parameters)."""
    named = list(model.named_parameters())
    canon = canonical_names(model, [n for n, _ in named])
    return {id(p): canon[name] for name, p in named}


def tied_names(model: torch.nn.Module) -> dict[str, str]:
    """Tied parameters: every further canonical name of a parameter → the name it is stored
    under (``lm_head.weight`` → ``transformer.wte.weight``); empty when nothing is tied."""
    named = list(model.named_parameters(remove_duplicate=False))
    canon = canonical_names(model, dict.fromkeys(n for n, _ in named))
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in named:
        c = canon[name]
        stored = first.setdefault(id(p), c)
        if stored != c:
            out[c] = stored
    return out


#: module attributes that hold an attention module's head count (torch, nanoGPT, Hugging
#: Face, common code); ``head_dim`` is recorded too (Llama-style modules have only that)
HEADS_ATTRIBUTES = ("num_heads", "n_head", "n_heads", "num_attention_heads", "heads")


def attention_heads(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """``{canonical module path: {"heads": n, "head_dim": d}}`` (either or both) of every
    module with a positive int attribute of :data:`HEADS_ATTRIBUTES` or ``head_dim``: what
    splits a query/key projection into heads (``run.explain``'s attention check)."""
    wrappers = module_wrappers(model)
    out: dict[str, dict[str, int]] = {}
    for name, module in model.named_modules():
        facts: dict[str, int] = {}
        for attr in HEADS_ATTRIBUTES:
            n = getattr(module, attr, None)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                facts["heads"] = n
                break
        dh = getattr(module, "head_dim", None)
        if isinstance(dh, int) and not isinstance(dh, bool) and dh > 0:
            facts["head_dim"] = dh
        if facts:
            out.setdefault(canonical_name(name, wrappers), facts)
    return out


class ModelInfoProvider:
    """What readers need to know of the model beyond its tensors, taken once at session
    start and stored with every step (encoded once): ``names/tied`` — every further name of a
    tied parameter → the name it is stored under (only when something is tied) —,
    ``model/config`` — a Hugging Face model's ``config`` as JSON (what ``dstt export --format
    hf`` writes as ``config.json``) — and ``model/heads`` — the attention modules' head
    counts (:func:`attention_heads`; only when there are some). Nothing to restore: they
    describe the model."""

    stable = True

    def __init__(self, model: torch.nn.Module) -> None:
        self._objects: dict[str, Encoded] = {}
        tied = tied_names(model)
        if tied:
            self._objects[TIED_OBJECT] = Encoded.of(tied)
        config = model_config(model)
        if config is not None:
            self._objects[CONFIG_OBJECT] = Encoded.of(config)
        heads = attention_heads(model)
        if heads:
            self._objects[HEADS_OBJECT] = Encoded.of(heads)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {}

    def objects(self) -> Mapping[str, Any]:
        return self._objects

    def restore(self, source: RestoreSource) -> None:
        return None


def model_config(model: torch.nn.Module) -> dict[str, Any] | None:
    """A Hugging Face ``PreTrainedModel``'s config as plain JSON (found through wrappers:
    ``torch.compile``, DDP), or None."""
    import json

    seen = 0
    while seen < 4 and getattr(model, "config", None) is None:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model, seen = inner, seen + 1
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        out = json.loads(to_json())
    except (TypeError, ValueError):
        return None
    return out if isinstance(out, dict) else None
