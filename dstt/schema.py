"""Names the training side and the readers agree on: store paths, dimensions, object names.

Every tensor is stored under its **canonical name**, the one a plain unwrapped
``model.state_dict()`` gives (:func:`canonical_name` drops ``_orig_mod.``, ``module.``, FSDP1
and activation-checkpointing components, as DCP does), at :func:`tensor_path`. A step's
objects are named by the append-only ``*_OBJECT`` constants, which every writer and reader
imports (``tests/test_schema_objects.py`` fails on a literal elsewhere); plain ``str``, not an
``Enum``, so messages and header keys show what a run stores. Standard library only, so the
store, the engine and the readers import it without importing each other. Rejected
alternative: stripping wrapper prefixes at read time only (export, ``load_into`` and resume
would each need the rule, and one model would be stored under two spellings).
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Collection, Mapping, Sequence

__all__ = [
    "BATCHES_OBJECT",
    "CONFIG_OBJECT",
    "DATA_OBJECT",
    "DEEPSPEED_ENGINE_OBJECT",
    "DEEPSPEED_META_OBJECT",
    "EXTRA_OBJECT",
    "FILES_OBJECT",
    "HEADS_OBJECT",
    "IMPORT_OBJECT",
    "LAYOUT_OBJECT",
    "LIGHT_OBJECT",
    "METRICS_HISTORY_OBJECT",
    "MODEL_KINDS",
    "OBJECT_NAMES",
    "OPTIM_GROUPS_OBJECT",
    "OPTIM_STATE_OBJECT",
    "REBUILT_OBJECT",
    "REPLAY_OBJECT",
    "RNG_OBJECT",
    "SCHEDULER_OBJECT",
    "SHARDS_OBJECT",
    "SUMMARIES_OBJECT",
    "SUMMARY_FIELDS",
    "SUMMARY_SCALARS",
    "TIED_OBJECT",
    "WRAPPER_ATTRIBUTES",
    "ZERO_SCALARS_OBJECT",
    "canonical_name",
    "declared_object",
    "optim_state",
    "resolve_dims",
    "tensor_path",
    "tree_location",
    "user_name",
]

#: top-level groups whose arrays are named by their dotted torch name (torch state_dict keys)
MODEL_KINDS = ("params", "buffers")

#: attributes through which wrappers hold the wrapped module, dropped wherever they appear
#: (reserved names: torch.compile's, FSDP1's and activation checkpointing's)
WRAPPER_ATTRIBUTES = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})

# -- object names (append-only: never rename or reuse one; add new ones at the end) ----------
# A name may have children: ``<name>/r<rank>`` (a rank's own copy), ``<name>/<key>`` (one of
# several optimizers), ``extra/<what>``; :func:`declared_object` accepts those.

#: write-time statistics of every ``params/`` tensor (``summaries/r<rank>`` per rank)
SUMMARIES_OBJECT: Final = "summaries"
#: tied parameters: ``{alias: stored name}``
TIED_OBJECT: Final = "names/tied"
#: the model's configuration (``config.to_dict()`` of a transformers model)
CONFIG_OBJECT: Final = "model/config"
#: which optimizer-state keys are arrays, and the others' values
OPTIM_STATE_OBJECT: Final = "optim/state"
#: the optimizer's param groups without their params
OPTIM_GROUPS_OBJECT: Final = "optim/param_groups"
#: the LR scheduler's ``state_dict()``
SCHEDULER_OBJECT: Final = "scheduler"
#: RNG states (python, numpy, torch, CUDA)
RNG_OBJECT: Final = "rng"
#: the data position (sampler/loader state)
DATA_OBJECT: Final = "data"
#: the dataset indices of the batches since the previous commit (``store/format/batches.py``)
BATCHES_OBJECT: Final = "data/batches"
#: metrics of the steps between two commits (``every=K``)
METRICS_HISTORY_OBJECT: Final = "metrics/history"
#: where an imported step came from (``dstt import``)
IMPORT_OBJECT: Final = "import/source"
#: the pipeline stages' parameter layout
LAYOUT_OBJECT: Final = "parallel/layout"
#: a DeepSpeed engine's counters, scheduler, param groups and loss scaler
DEEPSPEED_ENGINE_OBJECT: Final = "deepspeed/engine"
#: ZeRO stage and world of a DeepSpeed session
DEEPSPEED_META_OBJECT: Final = "deepspeed/meta"
#: shard maps, ``shards/r<rank>`` (docs/format.md §9)
SHARDS_OBJECT: Final = "shards"
#: ZeRO's non-array optimizer state, ``zero/scalars/r<rank>``
ZERO_SCALARS_OBJECT: Final = "zero/scalars"
#: state of other objects: ``extra/<name>`` (``extra_state=``, an importer's trainer state)
EXTRA_OBJECT: Final = "extra"
#: the skeletons of a DeepSpeed checkpoint's files, ``files/<id>``
FILES_OBJECT: Final = "files"
#: light steps (``every="auto"``) carried by the next stored commit: ``{"steps", "loss"}``
LIGHT_OBJECT: Final = "light/steps"
#: attention modules' head counts: ``{module path: {"heads": n} and/or {"head_dim": d}}``
HEADS_OBJECT: Final = "model/heads"
#: the factory a session named to rebuild its light steps (``replay="train.py:make"``):
#: ``{"factory": spec, "path": absolute file}``
REPLAY_OBJECT: Final = "replay/factory"
#: a rebuilt light step's derived commit (in memory, never in a run): its base and checks
REBUILT_OBJECT: Final = "light/rebuilt"

#: every declared object name, in the order they were added
OBJECT_NAMES: tuple[str, ...] = (
    SUMMARIES_OBJECT,
    TIED_OBJECT,
    CONFIG_OBJECT,
    OPTIM_STATE_OBJECT,
    OPTIM_GROUPS_OBJECT,
    SCHEDULER_OBJECT,
    RNG_OBJECT,
    DATA_OBJECT,
    BATCHES_OBJECT,
    METRICS_HISTORY_OBJECT,
    IMPORT_OBJECT,
    LAYOUT_OBJECT,
    DEEPSPEED_ENGINE_OBJECT,
    DEEPSPEED_META_OBJECT,
    SHARDS_OBJECT,
    ZERO_SCALARS_OBJECT,
    EXTRA_OBJECT,
    FILES_OBJECT,
    LIGHT_OBJECT,
    HEADS_OBJECT,
    REPLAY_OBJECT,
    REBUILT_OBJECT,
)

# -- the fields of one tensor's write-time summary (``SUMMARIES_OBJECT``) ---------------------
#: its scalars, in the index's column order (``store/format/segment.py``)
SUMMARY_SCALARS: Final = ("l2", "rms", "maxabs", "nan", "inf", "update_l2", "update_ratio")
#: every field: the scalars, the probed values, whether ``update_l2`` is exact
SUMMARY_FIELDS: Final = (*SUMMARY_SCALARS, "probe", "update_exact")


def declared_object(name: str) -> bool:
    """Whether ``name`` is a declared object name or one of its children
    (``rng/r1``, ``optim/state/0``, ``extra/lightning/hparams``)."""
    parts = name.split("/")
    return any("/".join(parts[:i]) in _DECLARED for i in range(1, len(parts) + 1))


_DECLARED = frozenset(OBJECT_NAMES)


def canonical_name(dotted: str, module_wrappers: Collection[str] = ()) -> str:
    """``dotted`` without wrapper components.

    Components in :data:`WRAPPER_ATTRIBUTES` are dropped wherever they appear; a component
    ``module`` is dropped only right after a module path listed in ``module_wrappers`` (the
    paths, as torch names them, of DDP/``DataParallel`` instances: ``""`` for the root), since
    a model may have a submodule of its own named ``module``.
    ``canonical_name("_orig_mod.module.layers.0.w", {"_orig_mod"}) == "layers.0.w"``.
    """
    parts = dotted.split(".")
    if not WRAPPER_ATTRIBUTES.intersection(parts) and not (module_wrappers and "module" in parts):
        return dotted
    kept: list[str] = []
    for i, part in enumerate(parts):
        if part not in WRAPPER_ATTRIBUTES and not (
            part == "module" and ".".join(parts[:i]) in module_wrappers
        ):
            kept.append(part)
    return ".".join(kept)


@functools.lru_cache(maxsize=1 << 16)
def tensor_path(prefix: str, dotted: str) -> str:
    """``params`` + ``layers.0.attn.weight`` → ``params/layers/0/attn/weight`` (cached: it
    runs for every tensor of every captured step)."""
    return f"{prefix}/{dotted.replace('.', '/')}"


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


def tree_location(path: str) -> tuple[str, str]:
    """(DataTree node path, variable name) of a store path.

    Parameters and buffers land at their module path (``layers/0/attn`` holds ``weight`` and
    ``bias``); everything else keeps its store group (``optim/exp_avg/layers/0/attn``).
    """
    parts = path.split("/")
    if parts[0] in MODEL_KINDS:
        parts = parts[1:]
    return "/".join(parts[:-1]), parts[-1]


def _ident(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)


def resolve_dims(
    named: Mapping[str, tuple[Sequence[str], Sequence[int]]],
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
                    name = next(
                        t for t in tries if t not in names and own.get(t, visible.get(t, n)) == n
                    )
                names.append(name)
                own[name] = int(n)
            out[path] = tuple(names)
        taken[node] = own
    return out
