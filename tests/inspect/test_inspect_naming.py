"""The name mapping and the layer selector rule (dstt.inspect.naming)."""

from __future__ import annotations

import re

import pytest

from dstt.inspect.naming import array_path, select, tensor_dims
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


def test_glob_matches_names_and_module_prefixes() -> None:
    assert select("layers.*.attn", PATHS) == [PATHS[1], PATHS[2], PATHS[4], PATHS[5], PATHS[6],
                                              PATHS[7]]
    assert select("layers.?.mlp.*", PATHS) == [PATHS[3]]
    assert select("*.bias", PATHS) == [PATHS[2]]
    assert select("nothing.*", PATHS) == []


def test_dims_are_local_unless_an_ancestor_has_the_same_name() -> None:
    paths = ["params/a/weight", "params/a/b/weight", "params/c/weight"]
    dims = tensor_dims(paths)
    assert dims("params/a/weight", 1) == ("weight_0",)
    assert dims("params/a/b/weight", 2) == ("a.b.weight_0", "a.b.weight_1")
    assert dims("params/c/weight", 2) == ("weight_0", "weight_1")
