"""The name mapping and the layer selector rule (dstt.inspect.naming)."""

from __future__ import annotations

import re

import pytest

from dstt.errors import TensorNotFoundError
from dstt.inspect.catalog import Catalog
from dstt.inspect.naming import array_path, canonical_path, suggest, tensor_dims
from dstt.inspect.selection import select, select_layer
from dstt.schema import optim_state, user_name

PATHS = [
    "params/embed/weight",
    "params/layers/0/attn/q_proj/weight",
    "params/layers/0/attn/q_proj/bias",
    "params/layers/0/mlp/weight",
    "params/layers/1/attn/q_proj/weight",
    "params/layers/10/attn/q_proj/weight",
    "buffers/layers/0/attn/mask",
    "optim/exp_avg/layers/0/attn/q_proj/weight",
    "params/blocks/attn/0/weight",
]


def test_user_names_round_trip() -> None:
    assert user_name("params/layers/0/attn/q_proj/weight") == "layers.0.attn.q_proj.weight"
    assert user_name("buffers/layers/0/attn/mask") == "layers.0.attn.mask"
    assert user_name("optim/exp_avg/layers/0/w") == "optim/exp_avg/layers/0/w"
    assert optim_state("optim/exp_avg/layers/0/w") == "exp_avg"
    assert optim_state("params/layers/0/w") is None
    for p in PATHS:
        assert array_path(user_name(p), PATHS) == p
    assert array_path("layers.0.attn.q_proj.weight", PATHS, state="exp_avg") == PATHS[7]


def test_unknown_name_suggests_close_ones() -> None:
    with pytest.raises(KeyError, match=re.escape("did you mean 'layers.0.attn.q_proj.weight'")):
        array_path("layers.0.attn.q_prj.weight", PATHS)


def test_contiguous_components_pick_subtrees_by_whole_components() -> None:
    got = select("layers.1", PATHS)
    assert got == ["params/layers/1/attn/q_proj/weight"]  # never layers.10
    assert select("layers.0.attn", PATHS) == [PATHS[1], PATHS[2], PATHS[6], PATHS[7]]
    assert select("q_proj.weight", PATHS) == [PATHS[1], PATHS[4], PATHS[5], PATHS[7]]
    assert select("layers.0.attn.q_proj.bias", PATHS) == [PATHS[2]]


def test_contiguous_match_wins_over_any_order() -> None:
    # 'attn.0' appears contiguously in blocks.attn.0, so layers.0.attn is not picked
    assert select("attn.0", PATHS) == ["params/blocks/attn/0/weight"]
    no_blocks = [p for p in PATHS if "blocks" not in p]
    assert select("attn.0", no_blocks) == [PATHS[1], PATHS[2], PATHS[6], PATHS[7]]


def test_glob_matches_at_any_depth_like_a_plain_selector() -> None:
    assert select("layers.*.attn", PATHS) == [
        PATHS[1],
        PATHS[2],
        PATHS[4],
        PATHS[5],
        PATHS[6],
        PATHS[7],
    ]
    assert select("layers.?.mlp.*", PATHS) == [PATHS[3]]
    assert select("*.bias", PATHS) == [PATHS[2]]
    assert select("nothing.*", PATHS) == []


def test_dims_are_local_unless_an_ancestor_has_the_same_name() -> None:
    paths = ["params/a/weight", "params/a/b/weight", "params/c/weight"]
    dims = tensor_dims(paths)
    assert dims("params/a/weight", 1) == ("weight_0",)
    assert dims("params/a/b/weight", 2) == ("a.b.weight_0", "a.b.weight_1")
    assert dims("params/c/weight", 2) == ("weight_0", "weight_1")


HF = [
    "params/model/embed_tokens/weight",
    "params/model/layers/0/self_attn/q_proj/weight",
    "params/model/layers/0/mlp/up_proj/weight",
    "params/model/layers/1/mlp/up_proj/weight",
    "params/model/layers/10/mlp/up_proj/weight",
    "params/lm_head/weight",
    "optim/exp_avg/model/layers/0/mlp/up_proj/weight",
]


def test_a_glob_matches_below_the_model_prefix_too() -> None:
    assert select("layers.*.mlp", HF) == [HF[2], HF[3], HF[4], HF[6]]
    assert select("layers.*.mlp", HF) == select("model.layers.*.mlp", HF)
    assert select("layers.1?.mlp", HF) == [HF[4]]
    assert select("*_proj.weight", HF) == [HF[1], HF[2], HF[3], HF[4], HF[6]]


def test_a_unique_suffix_of_whole_components_resolves() -> None:
    assert array_path("layers.0.self_attn.q_proj.weight", HF) == HF[1]
    assert array_path("embed_tokens.weight", HF) == HF[0]
    assert array_path("1.mlp.up_proj.weight", HF) == HF[3]  # never layers.10 or 11
    assert array_path("layers.0.mlp.up_proj.weight", HF, state="exp_avg") == HF[6]
    with pytest.raises(
        TensorNotFoundError,
        match=re.escape(
            "'mlp.up_proj.weight' is ambiguous in this commit: 3 tensors end with it "
            "(model.layers.0.mlp.up_proj.weight, model.layers.1.mlp.up_proj.weight, "
            "model.layers.10.mlp.up_proj.weight)"
        ),
    ):
        array_path("mlp.up_proj.weight", HF)
    with pytest.raises(
        TensorNotFoundError, match=re.escape("'layers.1' is a module, not a tensor")
    ):
        array_path("layers.1", HF)
    with pytest.raises(
        TensorNotFoundError,
        match=re.escape("did you mean 'model.layers.0.self_attn.q_proj.weight'"),
    ):
        array_path("layers.0.self_attn.q_prj.weight", HF)  # a short name with a typo


def test_wrapper_components_are_dropped_from_paths_and_typed_names() -> None:
    assert canonical_path("params/_orig_mod/l1/weight") == "params/l1/weight"
    assert (
        canonical_path("optim/exp_avg/_fsdp_wrapped_module/a/_checkpoint_wrapped_module/w")
        == "optim/exp_avg/a/w"
    )
    assert canonical_path("params/module/w") == "params/module/w"  # may be a real module
    assert array_path("_orig_mod.model.embed_tokens.weight", HF) == HF[0]
    assert select("layers.0.mlp", ["params/_orig_mod/model/layers/0/mlp/w"]) == [
        "params/_orig_mod/model/layers/0/mlp/w"
    ]


def test_suggestions_compare_short_names_with_suffixes() -> None:
    names = ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight"]
    assert suggest("layers.0.self_atn.q_proj.weight", names) == [names[0]]
    assert suggest("zzz", names) == []


def test_one_expert_of_fused_tensors_is_picked_only_where_nothing_else_matches() -> None:
    paths = [
        "params/m/layers/0/mlp/experts/gate_up_proj",
        "params/m/layers/0/mlp/experts/down",
        "params/m/layers/0/mlp/gate/weight",
        "params/m/layers/1/mlp/experts/down",
    ]
    fused = {paths[0], paths[1], paths[3]}

    def expert_dim(p: str) -> str | None:
        return "expert" if p in fused else None

    got, picks = select_layer("experts.0", paths, expert_dim)
    assert got == [paths[0], paths[1], paths[3]]
    assert picks == {p: ("expert", 0) for p in got}
    got, picks = select_layer("layers.0.mlp.experts.2.down", paths, expert_dim)
    assert got == [paths[1]]
    assert picks == {paths[1]: ("expert", 2)}
    # without fused tensors it stays rule 4 (all components, any order)
    assert select_layer("experts.0", paths, lambda p: None)[1] == {}
    # a model with experts as modules matches them contiguously, as always
    modules = ["params/m/experts/0/w", "params/m/experts/1/w"]
    assert select_layer("experts.0", modules, expert_dim) == ([modules[0]], {})


class _Rec:
    def __init__(self, path: str, shape: tuple[int, ...]) -> None:
        self.path, self.shape, self.dtype, self.dims = path, shape, "float32", None


def test_tied_names_are_aliases_of_their_target() -> None:
    table = {
        p: _Rec(p, (4, 2))
        for p in ("params/wte/weight", "optim/exp_avg/wte/weight", "params/mid/weight")
    }
    cat = Catalog(table, {"lm_head.weight": "wte.weight"})
    assert cat.tied == {
        "params/lm_head/weight": "params/wte/weight",
        "optim/exp_avg/lm_head/weight": "optim/exp_avg/wte/weight",
    }
    assert cat.names() == ["lm_head.weight", "mid.weight", "wte.weight"]
    assert cat.resolve("lm_head.weight") == "params/lm_head/weight"
    assert cat.table["params/lm_head/weight"].path == "params/wte/weight"  # the bytes: once
    assert cat.tied_to("params/lm_head/weight") == "wte.weight"
    assert cat.tied_to("params/wte/weight") is None
    assert cat.select("lm_head")[0] == ["params/lm_head/weight"]
    with pytest.raises(TensorNotFoundError, match="did you mean 'lm_head'"):
        cat.select("lm_haed")
