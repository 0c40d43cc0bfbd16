"""Names: store array paths <-> the names a PyTorch user types, and how a typed name resolves.

Views speak dotted torch names for parameters and buffers, store paths (which always contain
a ``/``) for everything else. :func:`array_path` resolves the exact name, then a **short
name** (a unique suffix of whole components; several matches are an error listing them);
wrapper components (:data:`dstt.schema.WRAPPER_ATTRIBUTES`) are dropped on both sides
(:func:`canonical_path`); a miss suggests the closest names, suffixes included.

Rejected alternatives: a ``state:name`` mini-syntax for optimizer states (one more grammar,
where the store path is already unique and what ``dstt show`` prints); short names by plain
substring (``layers.1`` would also name ``layers.10``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from difflib import SequenceMatcher
from typing import Any

from dstt.errors import TensorNotFoundError
from dstt.schema import (
    MODEL_KINDS,
    WRAPPER_ATTRIBUTES,
    canonical_name,
    optim_state,
    resolve_dims,
    tree_location,
    user_name,
)

__all__ = ["array_path", "canonical_path", "components", "listed", "suggest", "tensor_dims"]

_SHOW = 6  # names listed in an error message


def canonical_path(path: str) -> str:
    """``path`` without wrapper components (``params/_orig_mod/l1/weight`` ->
    ``params/l1/weight``); the kind (and an optimizer state's name) is kept."""
    if "/_" not in path:  # every wrapper attribute starts with '_': the common case is free
        return path
    parts = path.split("/")
    keep = 2 if parts[0] == "optim" else 1
    return "/".join(parts[:keep] + [c for c in parts[keep:] if c not in WRAPPER_ATTRIBUTES])


def components(path: str) -> list[str]:
    """Dotted components of a tensor's name without kind/state prefix or wrapper components
    (an optimizer state's: its parameter's)."""
    parts = canonical_path(path).split("/")
    if parts[0] in MODEL_KINDS:
        return parts[1:]
    if parts[0] == "optim" and len(parts) >= 3:
        return parts[2:]
    return parts


def listed(names: Iterable[str], n: int = _SHOW) -> str:
    """``a, b, c … (12 in all)``: a bounded list for an error message."""
    names = list(names)
    more = f" … ({len(names)} in all)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def suggest(name: str, names: Iterable[str], n: int = 3, cutoff: float = 0.6) -> list[str]:
    """The ``n`` of ``names`` closest to ``name``: each scored by its best similarity (difflib
    ratio) as a whole and as its suffix of as many components as ``name`` has."""
    k = name.count(".") + 1
    m = SequenceMatcher()
    m.set_seq2(name)
    best: dict[str, float] = {}
    for full in names:
        tail = ".".join(full.split(".")[-k:])
        for cand in {full, tail}:
            m.set_seq1(cand)
            if m.real_quick_ratio() >= cutoff and m.quick_ratio() >= cutoff:
                r = m.ratio()
                if r >= cutoff and r > best.get(full, 0.0):
                    best[full] = r
    return sorted(best, key=lambda f: (-best[f], len(f), f))[:n]


def array_path(
    name: str,
    available: Iterable[str] | Mapping[str, object],
    state: str | None = None,
    *,
    where: str = "in this commit",
    listing: str = "",
) -> str:
    """Resolve a user name to the store path present in ``available``.

    ``name`` is a dotted torch name (looked up under ``params/`` then ``buffers/``, or under
    ``optim/<state>/`` when ``state`` is given), a short name (a unique suffix of whole
    components of one) or a store path containing ``/``. Raises ``TensorNotFoundError`` (a
    ``KeyError``) when nothing fits — listing the candidates of an ambiguous short name, the
    tensors of a module named instead of a tensor, the states a tensor does have, or else the
    closest names; ``where`` says where it was looked for (``at step 3``) and ``listing`` how
    to list every name (``run.at(3).names()``).
    """
    avail = available if isinstance(available, Mapping) else set(available)
    name = canonical_path(name) if "/" in name else canonical_name(name)
    if "/" in name:
        if name in avail:
            return name
    else:
        kinds = [f"optim/{state}"] if state is not None else list(MODEL_KINDS)
        tail = "/" + name.replace(".", "/")
        for kind in kinds:
            if kind + tail in avail:
                return kind + tail
        hits = sorted(
            p for p in avail if p.endswith(tail) and any(p.startswith(kind + "/") for kind in kinds)
        )
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise TensorNotFoundError(
                f"{name!r} is ambiguous {where}: {len(hits)} tensors end with it "
                f"({listed(user_name(p) for p in hits)}); give more of the name"
            )
    see = f" (all names: {listing})" if listing else ""
    if state is not None and "/" not in name:
        _no_state(name, state, avail, where, see)
    model = [user_name(p) for p in avail if p.split("/")[0] in MODEL_KINDS]
    if "/" not in name:
        inside = [n for n in model if f".{name}." in f".{n}"]
        if inside:
            raise TensorNotFoundError(
                f"{name!r} is a module, not a tensor {where}: it holds {listed(sorted(inside))}; "
                f"name one of them (or take them all with .layer({name!r}))"
            )
    close = suggest(name, model if "/" not in name else [user_name(p) for p in avail])
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise TensorNotFoundError(f"no tensor named {name!r} {where}{hint}{see}")


def _no_state(name: str, state: str, avail: Iterable[str], where: str, see: str) -> None:
    """The error when a model tensor lacks the optimizer state asked for (if it is that)."""
    tail = "/" + name.replace(".", "/")
    mine = [p for p in avail if p.endswith(tail)]
    states = sorted(
        {s for p in mine if (s := optim_state(p)) is not None and p.startswith(f"optim/{s}/")}
    )
    if states:
        raise TensorNotFoundError(
            f"tensor {name!r} has no optimizer state {state!r} {where}; "
            f"its states: {', '.join(states)}"
        )
    if any(p.split("/")[0] in MODEL_KINDS for p in mine):
        raise TensorNotFoundError(
            f"tensor {name!r} has no optimizer states {where} (none saved yet, or the "
            f"optimizer keeps none for it); leave state unset for its values{see}"
        )


def tensor_dims(
    all_paths: Iterable[str] | Mapping[str, Any],
) -> Callable[[str, int], tuple[str, ...]]:
    """A function giving the dimension names of one tensor of a commit.

    ``all_paths`` is the commit's arrays table (path -> record; the whole commit rather than a
    selection, so names do not depend on what was selected) or just its paths. Records that
    carry ``dims`` (the names the engine stored in ``zarr.json``: ``out_features``, ...) give
    those, passed through :func:`resolve_dims` over the commit so that xarray can place them
    (records without: ``dim<i>``). A commit whose records carry none (written before dims
    were stored) keeps the names its ``zarr.json`` has, ``<param>_<i>`` (``weight_0``); as
    xarray's DataTree requires a node's dimensions to agree in size with its ancestors' ones,
    when an ancestor node holds a tensor of the same name the dims use the full dotted name
    instead (``layers.0.sub.weight_0``).
    """
    records = all_paths if isinstance(all_paths, Mapping) else {}
    stored = {
        p: tuple(d) for p, r in records.items() if (d := getattr(r, "dims", None)) is not None
    }
    if stored:
        resolved = resolve_dims(
            {
                p: (stored.get(p) or tuple(f"dim{i}" for i in range(len(r.shape))), tuple(r.shape))
                for p, r in records.items()
            }
        )
        return lambda path, ndim: resolved[path]
    held = {tree_location(p) for p in all_paths}

    def dims(path: str, ndim: int) -> tuple[str, ...]:
        node, var = tree_location(path)
        parts = node.split("/") if node else []
        clash = any(("/".join(parts[:k]), var) in held for k in range(len(parts)))
        prefix = path.replace("/", ".") if clash else var
        if clash and path.split("/")[0] in MODEL_KINDS:
            prefix = user_name(path)
        return tuple(f"{prefix}_{i}" for i in range(ndim))

    return dims
