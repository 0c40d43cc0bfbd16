"""The DeepSpeed support pieces that need no DeepSpeed process: state-dict flattening,
replicated-tensor ownership, engine detection, rank writers (world size 1)."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch

from dstt.engine._statedict import INLINE_NUMEL, flatten, rebuild, segment
from dstt.engine.deepspeed import is_deepspeed_engine, owners
from dstt.engine.ranks import RankInfo, open_ranks
from dstt.errors import TimelineError
from dstt.store import DeltaPolicy, Repository
from dstt.store.layout import check_array_path

from ._helpers import same_bits


def test_state_dict_roundtrip_keeps_tensors_live() -> None:
    big = torch.randn(5, 7)
    sd = collections.OrderedDict(
        module={"l1.weight": big, "c.odd key": torch.arange(40, dtype=torch.int64)},
        optimizer={"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(33)}},
                   "param_groups": [{"lr": 0.1, "params": [0]}]},
        shapes=(torch.Size([5, 7]),), version="0.19", scale=None,
        bf16=torch.randn(20).to(torch.bfloat16))
    tensors: dict[str, torch.Tensor] = {}
    skel = flatten(sd, "files/x", tensors)
    assert tensors["files/x/module/l1.weight"] is not big  # detached view, same storage
    assert tensors["files/x/module/l1.weight"].data_ptr() == big.data_ptr()
    for path in tensors:
        check_array_path(path)
    assert not any(t.numel() <= INLINE_NUMEL for t in tensors.values())  # step stays inline
    back = rebuild(skel, lambda p: tensors[p].clone())
    assert type(back) is collections.OrderedDict
    assert same_bits(back["module"]["l1.weight"], big)
    assert same_bits(back["optimizer"]["state"][0]["step"], torch.tensor(3.0))
    assert same_bits(back["bf16"], sd["bf16"])
    assert back["shapes"] == (torch.Size([5, 7]),) and back["version"] == "0.19"
    assert back["optimizer"]["param_groups"] == [{"lr": 0.1, "params": [0]}]


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
    assert head is not None and head.step == 1
    assert Repository.open(tmp_path / "run").verify().ok


def test_deltas_need_a_single_rank(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="several ranks"):
        open_ranks(tmp_path / "run", RankInfo(0, 2), resume=False, chunk_bytes=64,
                   encoding=DeltaPolicy())
