"""Names: store array paths <-> the names a PyTorch user types, and the layer selector rule.

The store keeps one array per tensor under ``params/<module path with '/'>/<param>``,
``buffers/...`` and ``optim/<state>/<module path>/<param>``. Users think in dotted torch names
(``layers.0.attn.q_proj.weight``), so every view speaks those: a parameter or buffer is named
by its dotted name, anything else (optimizer states, user arrays) by its store path, which
always contains a ``/`` and therefore never collides with a dotted name.

Rejected alternative: a ``state:name`` mini-syntax for optimizer states — one more grammar to
learn, where the store path is already unique, printable and what ``dstt show`` prints.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import TensorNotFoundError
from ..schema import MODEL_KINDS, optim_state, resolve_dims, tree_location, user_name

__all__ = ["array_path", "select", "selector_miss", "tensor_dims"]

_GLOB_CHARS = set("*?[")


def array_path(name: str, available: Iterable[str] | Mapping[str, object],
               state: str | None = None, *, where: str = "in this commit",
               listing: str = "") -> str:
    """Resolve a user name to the store path present in ``available``.

    ``name`` is a dotted torch name (looked up under ``params/`` then ``buffers/``, or under
    ``optim/<state>/`` when ``state`` is given) or a store path containing ``/``.
    Raises ``TensorNotFoundError`` (a ``KeyError``) naming the closest names, or the states the
    tensor does have, when nothing fits; ``where`` says where it was looked for (``at step
    3``) and ``listing`` how to list every name (``run.at(3).names()``).
    """
    avail = available if isinstance(available, Mapping) else set(available)
    if "/" in name:
        candidates = [name]
    elif state is not None:
        candidates = [f"optim/{state}/{name.replace('.', '/')}"]
    else:
        candidates = [f"{kind}/{name.replace('.', '/')}" for kind in MODEL_KINDS]
    for c in candidates:
        if c in avail:
            return c
    see = f" (all names: {listing})" if listing else ""
    if state is not None and "/" not in name:
        tail = "/" + name.replace(".", "/")
        states = sorted({s for p in avail if p.endswith(tail)
                         and (s := optim_state(p)) is not None and p == f"optim/{s}{tail}"})
        if states:
            raise TensorNotFoundError(
                f"tensor {name!r} has no optimizer state {state!r} {where}; its states: "
                f"{', '.join(states)}")
        if any(f"{kind}{tail}" in avail for kind in MODEL_KINDS):
            raise TensorNotFoundError(
                f"tensor {name!r} has no optimizer states {where} (none saved yet, or the "
                f"optimizer keeps none for it); leave state unset for its values{see}")
    close = _close_matches(name, avail)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise TensorNotFoundError(f"no tensor named {name!r} {where}{hint}{see}")


def _close_matches(name: str, avail: Iterable[str]) -> list[str]:
    import difflib

    names = [user_name(p) for p in avail]
    return difflib.get_close_matches(name, names, n=3, cutoff=0.6)


def _components(path: str) -> list[str]:
    """Dotted components of the tensor's name without kind/state prefix."""
    parts = path.split("/")
    if parts[0] in MODEL_KINDS:
        return parts[1:]
    if parts[0] == "optim" and len(parts) >= 3:
        return parts[2:]
    return parts


def select(selector: str, paths: Iterable[str]) -> list[str]:
    """Store paths whose tensors ``selector`` picks. The rule, in order:

    1. **Glob** (the selector contains ``*``, ``?`` or ``[``): ``fnmatch`` against the dotted
       tensor name and each of its module prefixes, so ``layers.*.attn`` picks every tensor
       under any ``layers.<i>.attn`` and ``layers.*.attn.*`` the same tensors; ``*`` also
       crosses dots.
    2. **Contiguous components**: the dotted selector's components appear as a contiguous run
       in the tensor's dotted name. ``layers.0.attn`` picks the subtree ``layers.0.attn.*``,
       ``q_proj.weight`` every q_proj weight, an exact tensor name picks that tensor. Matching
       is by whole components: ``layers.1`` never picks ``layers.10``.
    3. **All components, any order** (only when rule 2 picks nothing): every component of
       the selector appears in the name. ``attn.0`` picks ``layers.0.attn.*`` in a model whose
       modules are spelled that way.

    Optimizer-state paths are matched on their module path (the ``optim/<state>`` prefix is
    ignored), so one selector picks a parameter and its optimizer states alike. Returns the
    matching paths in input order; an empty list when nothing matches.
    """
    paths = list(paths)
    dotted = {p: ".".join(_components(p)) for p in paths}
    if _GLOB_CHARS & set(selector):
        def hit(p: str) -> bool:
            c = dotted[p].split(".")
            return any(fnmatch.fnmatchcase(".".join(c[:k]), selector)
                       for k in range(1, len(c) + 1))
        return [p for p in paths if hit(p)]
    want = [s for s in selector.split(".") if s]
    if not want:
        return paths
    # components never contain '.', so a contiguous run of them is a '.'-bounded substring
    needle = "." + ".".join(want) + "."
    found = [p for p in paths if needle in f".{dotted[p]}."]
    if found:
        return found
    return [p for p in paths if set(want) <= set(dotted[p].split("."))]


def tensor_dims(all_paths: Iterable[str] | Mapping[str, Any]
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
    stored = {p: tuple(d) for p, r in records.items() if (d := getattr(r, "dims", None))
              is not None}
    if stored:
        resolved = resolve_dims({p: (stored.get(p) or tuple(f"dim{i}" for i in range(len(
            r.shape))), tuple(r.shape)) for p, r in records.items()})
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


def selector_miss(selector: str, paths: Iterable[str], where: str,
                  listing: str = "") -> TensorNotFoundError:
    """The error for a layer selector that picks nothing among ``paths``: the closest module
    paths and tensor names, or the top-level modules when none is close."""
    import difflib

    names = {".".join(_components(p)) for p in paths}  # optimizer states: their module path
    prefixes = sorted({".".join(n.split(".")[:k]) for n in names
                       for k in range(1, n.count(".") + 2)})
    close = difflib.get_close_matches(selector, prefixes, n=3, cutoff=0.6)
    if close:
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?"
    else:
        tops = sorted({n.split(".")[0] for n in names})
        more = f" … ({len(tops)} in all)" if len(tops) > 20 else ""
        hint = f"; top-level modules: {', '.join(tops[:20]) or '—'}{more}"
    see = f" (all names: {listing})" if listing else ""
    return TensorNotFoundError(f"selector {selector!r} matches no tensor {where}{hint}{see}")
