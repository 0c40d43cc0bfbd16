"""The layer selector rule: which tensors ``layer('layers.*.mlp')``, ``dstt show --select``,
``diff``, the plots and the widgets pick — one rule for all of them.

A selector matches a tensor's dotted name (wrappers dropped; an optimizer state by its
parameter's name) at any depth, whole components at a time, by the first rule that picks
anything: a **glob** against every run of consecutive components; **contiguous components**
(``layers.1`` never picks ``layers.10``); **one expert of fused experts** (``experts.0``:
expert 0 of tensors whose first dim is ``expert``, narrowed); **all components, any order**.

Rejected alternative: globs anchored at the start of the name while plain selectors match
anywhere — ``layers.*.mlp`` then found nothing in a Hugging Face model (``model.layers...``)
although ``layers.0.mlp`` did, and the plots drew empty charts instead of saying so.
"""

from __future__ import annotations

import fnmatch
import re
from typing import TYPE_CHECKING

from dstt.errors import TensorNotFoundError

from .naming import components, listed, suggest

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

__all__ = ["Pick", "select", "select_layer", "selector_miss"]

_GLOB_CHARS = set("*?[")

#: an expert of a fused tensor: store path -> (dimension name, index)
Pick = dict[str, tuple[str, int]]


def select(selector: str, paths: Iterable[str]) -> list[str]:
    """Store paths whose tensors ``selector`` picks (rules 1, 2 and 4 of the module
    docstring), in input order; an empty list when nothing matches."""
    return select_layer(selector, paths)[0]


def select_layer(
    selector: str, paths: Iterable[str], expert_dim: Callable[[str], str | None] | None = None
) -> tuple[list[str], Pick]:
    """The paths ``selector`` picks by the whole rule, and the experts picked of fused
    tensors (rule 3; ``expert_dim(path)`` names a path's leading expert dimension, None when
    it has none)."""
    paths = list(paths)
    dotted = {p: components(p) for p in paths}
    if _GLOB_CHARS & set(selector):
        match = re.compile(fnmatch.translate(selector)).match

        return [p for p in paths if any(map(match, _runs(dotted[p])))], {}
    want = [s for s in selector.split(".") if s]
    if not want:
        return paths, {}
    # components never contain '.', so a run of them is a '.'-bounded substring
    needle = "." + ".".join(want) + "."
    found = [p for p in paths if needle in "." + ".".join(dotted[p]) + "."]
    if found:
        return found, {}
    if expert_dim is not None:
        picked = _experts(want, paths, dotted, expert_dim)
        if picked:
            return list(picked), picked
    return [p for p in paths if set(want) <= set(dotted[p])], {}


def _runs(c: list[str]) -> Iterator[str]:
    """Every run of consecutive components of ``c``, dotted."""
    return (".".join(c[i:j]) for i in range(len(c)) for j in range(i + 1, len(c) + 1))


def _experts(
    want: list[str],
    paths: list[str],
    dotted: dict[str, list[str]],
    expert_dim: Callable[[str], str | None],
) -> Pick:
    """Rule 3: ``<module>.<i>[.<param>]`` over tensors with a leading expert dimension."""
    for k in range(max(1, len(want) - 2), len(want)):  # the index: last or next to last
        if not want[k].isdigit():
            continue
        module, index, rest = want[:k], int(want[k]), want[k + 1 :]
        out: Pick = {}
        for p in paths:
            c = dotted[p]
            if c[-1 - len(module) : -1] != module or (rest and c[-1] != rest[0]):
                continue
            dim = expert_dim(p)
            if dim is not None:
                out[p] = (dim, index)
        if out:
            return out
    return {}


def selector_miss(
    selector: str, paths: Iterable[str], where: str, listing: str = ""
) -> TensorNotFoundError:
    """The error for a selector that picks nothing among ``paths``: the closest runs of
    components (each a selector that picks something), or the top-level modules when none is
    close."""
    names = {".".join(components(p)) for p in paths}  # optimizer states: their module path
    close = suggest(selector, {r for n in names for r in _runs(n.split("."))})
    if close:
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?"
    else:
        tops = sorted({n.split(".")[0] for n in names})
        hint = f"; top-level modules: {listed(tops, 20) or '—'}"
    see = f" (all names: {listing})" if listing else ""
    return TensorNotFoundError(f"selector {selector!r} matches no tensor {where}{hint}{see}")
