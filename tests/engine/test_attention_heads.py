"""The attention modules' head counts ride with every commit as ``model/heads`` (what
``run.explain`` splits a query/key projection by): found on modules' own attributes
(``num_heads``, ``n_head``, ``heads``, ..., or only ``head_dim``), under canonical module
paths through wrappers, absent when a model has no attention."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import dstt
from dstt import schema
from dstt.engine.state.model_names import attention_heads
from dstt.testing.models import TinyGPT
from dstt.training import session

from ._helpers import MLP


class HeadDimOnly(nn.Module):
    """A Llama-style attention module: it keeps ``head_dim``, not the head count."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = 4
        self.q_proj = nn.Linear(16, 16)
        self.k_proj = nn.Linear(16, 8)  # grouped-query: two key heads


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2)
        self.attn = HeadDimOnly()
        self.flag = nn.Module()
        self.flag.heads = True  # a bool is no head count


def test_head_counts_come_from_the_modules_attributes() -> None:
    got = attention_heads(torch.compile(Mixed(), backend="eager"))
    assert got == {"mha": {"heads": 2, "head_dim": 8}, "attn": {"head_dim": 4}}
    tiny = attention_heads(TinyGPT(vocab=16, d=16, layers=2, heads=4, seq=8))
    assert tiny == {"layers.0": {"heads": 4}, "layers.1": {"heads": 4}}
    assert attention_heads(MLP()) == {}


def test_a_session_stores_them_with_every_commit_and_only_when_there_are_some(
    tmp_path: Path,
) -> None:
    model = TinyGPT(vocab=16, d=16, layers=2, heads=2, seq=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with session(model, opt, run=tmp_path / "gpt", every=1) as s:
        for _ in range(2):
            s.mark_step()
    run = dstt.open(tmp_path / "gpt")
    for step in (1, 2):
        assert run.at(step).object(schema.HEADS_OBJECT) == {
            "layers.0": {"heads": 2},
            "layers.1": {"heads": 2},
        }
    mlp = MLP()
    with session(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), run=tmp_path / "mlp") as s:
        s.mark_step()
    assert schema.HEADS_OBJECT not in dstt.open(tmp_path / "mlp").at(1).objects


def test_a_hugging_face_attention_is_found_under_its_path(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    got = attention_heads(transformers.GPT2LMHeadModel(cfg))
    assert {p: f["heads"] for p, f in got.items()} == {
        "transformer.h.0.attn": 2,
        "transformer.h.1.attn": 2,
    }
