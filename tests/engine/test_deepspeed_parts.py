"""The DeepSpeed support pieces that need no DeepSpeed process: state-dict flattening,
replicated-tensor ownership, engine detection, rank writers (world size 1)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from dstt.engine.distributed.ranks import RankInfo, open_ranks
from dstt.engine.distributed.sharding import owners
from dstt.engine.ds._statedict import SessionPaths, flatten, rebuild, segment
from dstt.engine.ds.deepspeed import is_deepspeed_engine
from dstt.errors import TimelineError
from dstt.store._internal import DeltaPolicy, Repository, check_array_path

from ._helpers import same_bits


def test_state_dict_roundtrip_keeps_tensors_live() -> None:
    big = torch.randn(5, 7)
    sd = collections.OrderedDict(
        module={"l1.weight": big, "c.odd key": torch.arange(40, dtype=torch.int64)},
        optimizer={
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(33)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
        shapes=(torch.Size([5, 7]),),
        version="0.19",
        scale=None,
        bf16=torch.randn(20).to(torch.bfloat16),
    )
    tensors: dict[str, torch.Tensor] = {}
    skel = flatten(sd, "files/x", tensors)
    assert tensors["files/x/module/l1.weight"] is not big  # detached view, same storage
    assert tensors["files/x/module/l1.weight"].data_ptr() == big.data_ptr()
    for path in tensors:
        check_array_path(path)
    step = tensors["files/x/optimizer/state/0/step"]  # 0-d: an array too, visible to names()
    assert step.shape == ()
    assert step.data_ptr() == sd["optimizer"]["state"][0]["step"].data_ptr()
    back = rebuild(skel, lambda p: tensors[p].clone())
    assert type(back) is collections.OrderedDict
    assert same_bits(back["module"]["l1.weight"], big)
    assert same_bits(back["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    assert same_bits(back["bf16"], sd["bf16"])
    assert back["shapes"] == (torch.Size([5, 7]),)
    assert back["version"] == "0.19"
    assert back["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_state_dict_tensors_take_the_paths_place_gives() -> None:
    w, b = torch.randn(3, 4), torch.randn(8)
    sd = {"module": {"l1.weight": w, "l1.bias": b}, "empty": torch.empty(0)}
    names = {w.data_ptr(): "params/l1/weight", b.data_ptr(): "params/l1/bias"}
    tensors: dict[str, torch.Tensor] = {}
    skel = flatten(sd, "files/m", tensors, lambda t, default: names.get(t.data_ptr(), default))
    assert sorted(tensors) == ["params/l1/bias", "params/l1/weight"]  # 8 elements: an array
    back = rebuild(skel, lambda p: tensors[p].clone())
    assert same_bits(back["module"]["l1.weight"], w)
    assert same_bits(back["module"]["l1.bias"], b)
    assert back["empty"].shape == (0,)  # empty tensors stay inline


class _Zero:
    """What SessionPaths needs of a ZeroState: its shard map."""

    def shard_map(self) -> dict[str, object]:
        return {
            "format": 1,
            "arrays": {
                "params/a": {
                    "dtype": "float32",
                    "shape": [6],
                    "pieces": [["zero/g0/fp32", 0, 0, 6]],
                },
                "params/pad": {
                    "dtype": "float32",
                    "shape": [4],
                    "pieces": [["zero/g0/fp32", 6, 0, 4]],
                },
            },
        }


def test_session_paths_by_storage_identity() -> None:
    flat, w = torch.randn(10), torch.randn(2, 3)
    names = SessionPaths({"zero/g0/fp32": flat, "params/w": w}, _Zero())
    assert names.place(flat[:8], "files/f/fp32") == "zero/g0/fp32"  # unpadded prefix view
    assert names.place(flat, "files/f/full") == "files/f/full"  # another view took the path
    assert names.place(w.detach(), "files/m/w") == "params/w"
    assert names.place(w.t(), "files/m/wt") == "files/m/wt"  # same storage, other view
    assert names.place(w.clone(), "files/m/copy") == "files/m/copy"
    # the logical array reaching past the saved prefix is left out of the rank's shard map
    assert sorted(names.shard_map()["arrays"]) == ["params/a"]  # type: ignore[index]


def test_segments_are_valid_and_unique() -> None:
    used: set[str] = set()
    names = [segment(k, used) for k in ("a b", "a_b", "c.x", "zarr.json", 3, "a b")]
    assert len(set(names)) == len(names)
    for n in names:
        check_array_path(n)


def test_owners_balance_and_agree() -> None:
    sizes = {f"p{i}": s for i, s in enumerate([100, 90, 10, 10, 5, 1, 1])}
    a, b = owners(sizes, 2), owners(dict(reversed(list(sizes.items()))), 2)
    assert a == b  # independent of order: every rank computes the same owners
    load = [sum(s for p, s in sizes.items() if a[p] == r) for r in (0, 1)]
    assert max(load) - min(load) <= 10
    assert set(owners(sizes, 1).values()) == {0}


def test_detection_does_not_need_deepspeed() -> None:
    assert not is_deepspeed_engine(torch.nn.Linear(2, 2))
    fake = type("DeepSpeedEngine", (torch.nn.Module,), {"__module__": "mylib.engine"})()
    assert not is_deepspeed_engine(fake)  # the name alone is not enough


def test_single_rank_writer(tmp_path: Path) -> None:
    rw, head = open_ranks(tmp_path / "run", RankInfo(0, 1), resume=False, chunk_bytes=64)
    try:
        assert head is None
        t1, t2 = rw.begin(1), rw.begin(2)
        assert (t1.slot, t2.slot) == (0, 1)
        t1.commit({"loss": 1.0})
        t2.abort()
    finally:
        rw.close()
    with pytest.raises(TimelineError, match="resume=True"):
        open_ranks(tmp_path / "run", RankInfo(0, 1), resume=False, chunk_bytes=64)
    rw, head = open_ranks(tmp_path / "run", RankInfo(0, 1), resume=True, chunk_bytes=64)
    rw.close()
    assert head is not None
    assert head.step == 1
    assert Repository.open(tmp_path / "run").verify().ok


def test_deltas_need_a_single_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="several ranks"):
        open_ranks(
            tmp_path / "run", RankInfo(0, 2), resume=False, chunk_bytes=64, encoding=DeltaPolicy()
        )
