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
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ..errors import TensorNotFoundError

__all__ = [
    "MODEL_KINDS",
    "array_path",
    "optim_state",
    "resolve_dims",
    "select",
    "selector_miss",
    "tensor_dims",
    "tree_location",
    "user_name",
]

#: top-level groups whose arrays are named by their dotted torch name (torch state_dict keys)
MODEL_KINDS = ("params", "buffers")
_GLOB_CHARS = set("*?[")


def user_name(path: str) -> str:
    """``params/layers/0/attn/weight`` -> ``layers.0.attn.weight``; other paths unchanged."""
    kind, _, rest = path.partition("/")
    if kind in MODEL_KINDS and rest:
        return rest.replace("/", ".")
    return path


def optim_state(path: str) -> str | None:
    """``optim/exp_avg/layers/0/w`` -> ``exp_avg``; None for non-optimizer arrays."""
    parts = path.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == "optim" else None


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


def tree_location(path: str) -> tuple[str, str]:
    """(DataTree node path, variable name) of a store path.

    Parameters and buffers land at their module path (``layers/0/attn`` holds ``weight`` and
    ``bias``); everything else keeps its store group (``optim/exp_avg/layers/0/attn``).
    """
    parts = path.split("/")
    if parts[0] in MODEL_KINDS:
        parts = parts[1:]
    return "/".join(parts[:-1]), parts[-1]


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


def _ident(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def resolve_dims(named: Mapping[str, tuple[Sequence[str], Sequence[int]]]
                 ) -> dict[str, tuple[str, ...]]:
    """Dimension names xarray can place, from wanted names: ``{path: (dims, shape)}`` of a
    whole commit -> ``{path: dims}``.

    A DataTree node (:func:`tree_location`) and its ancestors must not use one name for two
    sizes. Nodes are named root first, variables in name order; a name already taken with
    another size (in the node or an ancestor) becomes ``<dim>_<variable>``, and if that is
    taken too ``<dim>_<node>_<variable>``. Equal sizes share a name (a Linear's weight and
    bias share ``out_features``), and names depend only on the commit, never on a selection.
    """
    by_node: dict[str, list[tuple[str, str]]] = {}
    for path in named:
        node, var = tree_location(path)
        by_node.setdefault(node, []).append((var, path))
    taken: dict[str, dict[str, int]] = {}  # node -> its own names and sizes
    above: dict[str, dict[str, int]] = {"": {}}  # node -> the names of its ancestors

    def visible_of(node: str) -> dict[str, int]:
        got = above.get(node)
        if got is None:  # ancestors are named before their descendants: theirs are final
            parent = node.rsplit("/", 1)[0] if "/" in node else ""
            up, theirs = visible_of(parent), taken.get(parent)
            got = above[node] = {**up, **theirs} if theirs else up
        return got

    out: dict[str, tuple[str, ...]] = {}
    for node in sorted(by_node, key=lambda n: (n.count("/") if n else -1, n)):
        visible = visible_of(node)
        own: dict[str, int] = {}
        for var, path in sorted(by_node[node]):
            dims, shape = named[path]
            names: list[str] = []
            for d, n in zip(dims, shape, strict=True):
                name = d
                if d in names or own.get(d, visible.get(d, n)) != n:  # rare: only then
                    tries = [_ident(f"{d}_{var}"), _ident(f"{d}_{node}_{var}")]
                    tries += [f"{tries[-1]}_{i}" for i in range(len(names) + 2)]
                    name = next(t for t in tries if t not in names
                                and own.get(t, visible.get(t, n)) == n)
                names.append(name)
                own[name] = int(n)
            out[path] = tuple(names)
        taken[node] = own
    return out


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
