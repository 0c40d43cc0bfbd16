"""Real transformers architectures read back by the names users type (issue 27, read side).

Tiny Llama (``torch.compile(..., backend="eager")``d), GPT-2 (tied ``lm_head`` ↔
``transformer.wte``) and Mixtral (fused MoE experts), built from configs on CPU with random
init, nothing downloaded, each trained three steps in a plain loop under ``dstt.session``;
plus a run written the way capture used to write a compiled model (``_orig_mod.`` in every
path). Proves: every entry point finds a tensor by its full name and by its name without the
model prefix; selectors match at any depth and a miss says what was meant; tied names resolve
and say so; ``load_into`` is exact into the plain and the compiled model; the safetensors
export loads with ``load_state_dict`` and the ``hf`` export with ``from_pretrained``, giving
identical logits; fused experts are named ``expert`` and ``layer('experts.0')`` is expert 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.cli import main
from dstt.errors import ConfigError, TensorNotFoundError
from dstt.store import save

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def _llama() -> Any:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
    )


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=16,
            n_head=2,
            vocab_size=VOCAB,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def _mixtral() -> Any:
    return transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_local_experts=3,
            num_experts_per_tok=2,
            max_position_embeddings=16,
        )
    )


IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _train(build: Any, path: Path, *, compiled: bool) -> Any:
    torch.manual_seed(0)
    model = build()
    target = torch.compile(model, backend="eager") if compiled else model
    opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    with dstt.session(target, opt, run=path) as s:
        for _ in range(3):
            loss = target(input_ids=IDS, labels=IDS).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=float(loss.detach()))
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf")
    out = {}
    for name, build, compiled in (
        ("llama", _llama, True),
        ("gpt2", _gpt2, False),
        ("mixtral", _mixtral, False),
    ):
        out[name] = (root / name, _train(build, root / name, compiled=compiled))
    return out


def _same(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def test_names_resolve_with_and_without_the_model_prefix(
    runs: dict[str, tuple[Path, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    path, model = runs["llama"]  # captured through torch.compile: plain names stored
    run = dstt.open(path)
    snap = run.at(3)
    assert not any("_orig_mod" in n for n in snap.names(optim=True))
    full, short = "model.layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.weight"
    want = model.get_parameter(full).detach().numpy()
    for name in (full, short, "0.self_attn.q_proj.weight"):
        assert snap.tensor(name).name == full
        assert _same(snap.tensor(name), want)
        assert _same(run.trajectory(name).sel(step=3), want)
        assert _same(snap.to_numpy(name), want)
    assert snap.path("embed_tokens.weight") == "params/model/embed_tokens/weight"
    assert (
        snap.path("layers.1.mlp.up_proj.weight", state="exp_avg")
        == "optim/exp_avg/model/layers/1/mlp/up_proj/weight"
    )
    # selectors match at any depth, a glob as a plain one
    mlp = {".".join(p.split("/")[1:]) for p in snap.catalog.select("layers.*.mlp")[0]}
    assert mlp == {
        f"model.layers.{i}.mlp.{m}_proj.weight" for i in (0, 1) for m in ("gate", "up", "down")
    }
    assert set(snap.layer("layers.*.mlp")["model/layers/1/mlp"].children) == {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    assert main(["show", str(path), "--select", "layers.*.mlp", "--json"]) == 0
    assert '"model.layers.0.mlp.up_proj.weight"' in capsys.readouterr().out
    assert main(["diff", str(path), "2", "3", "--select", "layers.1.mlp"]) == 0
    assert "model.layers.1.mlp.down_proj.weight" in capsys.readouterr().out


def test_a_miss_says_what_was_meant(
    runs: dict[str, tuple[Path, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    run = dstt.open(runs["llama"][0])
    snap = run.at(3)
    with pytest.raises(
        TensorNotFoundError,
        match=r"ambiguous.*model\.layers\.0\.mlp\.up_proj"
        r"\.weight, model\.layers\.1\.mlp\.up_proj\.weight",
    ):
        snap.tensor("mlp.up_proj.weight")
    with pytest.raises(
        TensorNotFoundError,
        match=r"'layers\.0' is a module, not a tensor.*"
        r"model\.layers\.0\.input_layernorm\.weight",
    ):
        run.trajectory("layers.0")
    with pytest.raises(
        TensorNotFoundError, match=r"did you mean 'model\.layers\.0\.self_attn\.q_proj\.weight'"
    ):
        snap.tensor("layers.0.self_atn.q_proj.weight")
    with pytest.raises(TensorNotFoundError, match=r"did you mean 'layers\.0\.mlp'"):
        snap.layer("layers.0.mlpp")
    assert main(["show", str(run.path), "--select", "layers.*.mlpp"]) == 2
    assert "did you mean" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    from dstt import plots
    from dstt.plots.series import tensor_stats

    for draw in (
        lambda: tensor_stats(run, selector="layers.*.mlpp"),
        lambda: plots.norms(run, selector="layers.*.mlpp"),
        lambda: plots.update_heatmap(run, selector="nothing.here", spikes=None),
    ):
        with pytest.raises(TensorNotFoundError, match="matches no tensor"):
            draw()
    ax = plots.norms(run, selector="layers.*.mlp")  # and a hit draws every one
    assert len(ax.get_lines()) == 6


def test_tied_names_resolve_everywhere_and_say_they_are_tied(
    runs: dict[str, tuple[Path, Any]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    path, model = runs["gpt2"]
    run = dstt.open(path)
    snap = run.at(3)
    assert snap.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert "lm_head.weight" in snap.names()
    da = snap.tensor("lm_head.weight")
    assert da.attrs["tied_to"] == "transformer.wte.weight"
    assert da.name == "lm_head.weight"
    assert _same(da, model.lm_head.weight.detach())
    traj = run.trajectory("lm_head.weight")
    assert traj.attrs["tied_to"] == "transformer.wte.weight"
    assert _same(traj.sel(step=3), model.transformer.wte.weight.detach())
    tree = snap.layer("lm_head")
    assert tree["lm_head/weight"].attrs["tied_to"] == "transformer.wte.weight"
    assert (
        snap.tensor("lm_head.weight", state="exp_avg").attrs["tied_to"]
        == "optim/exp_avg/transformer/wte/weight"
    )
    assert main(["show", str(path), "--select", "lm_head"]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if "lm_head.weight" in x)
    assert "tied to transformer.wte.weight" in row
    from dstt.widgets.model import ScrubberModel

    m = ScrubberModel(run, tensor="lm_head.weight")
    assert m.tensor == "lm_head.weight"
    assert "lm_head.weight" in m.tensors
    assert _same(m.values(), model.lm_head.weight.detach())
    # the export holds every name: load_state_dict(load_file(f)) is strict and exact
    out = tmp_path / "gpt2.safetensors"
    snap.export(out)
    fresh = _gpt2()
    fresh.load_state_dict(load_file(out))
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    # state_dict lists every name, as torch does: one tensor under both
    sd = snap.state_dict()["model"]
    assert sd["lm_head.weight"] is sd["transformer.wte.weight"]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
@pytest.mark.parametrize("compiled", [False, True])
def test_load_into_is_exact_into_the_plain_and_the_compiled_model(
    runs: dict[str, tuple[Path, Any]], name: str, compiled: bool
) -> None:
    path, model = runs[name]
    build = {"llama": _llama, "gpt2": _gpt2}[name]
    torch.manual_seed(5)
    fresh = build()
    target = torch.compile(fresh, backend="eager") if compiled else fresh
    opt = torch.optim.AdamW(target.parameters(), lr=1e-2)
    result = dstt.open(path).at(3).load_into(target, opt)
    assert result.missing_keys == []
    assert result.unexpected_keys == []
    assert len(result.loaded_keys) == len(target.state_dict())
    for (n, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert len(opt.state) == len(list(fresh.parameters()))


def test_hf_export_opens_with_from_pretrained_and_gives_identical_logits(
    runs: dict[str, tuple[Path, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("llama", "gpt2", "mixtral"):
        path, model = runs[name]
        out = tmp_path / name
        assert main(["export", str(path), "--format", "hf", "-o", str(out)]) == 0, (
            capsys.readouterr().err
        )
        assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
        loaded = type(model).from_pretrained(out)
        model.eval()
        with torch.no_grad():
            assert torch.equal(loaded(input_ids=IDS).logits, model(input_ids=IDS).logits), name
    capsys.readouterr()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "gpt2" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # as save_pretrained writes a tied model
        assert f.metadata()["format"] == "pt"


def test_hf_export_of_a_run_without_a_config_needs_one(
    runs: dict[str, tuple[Path, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = runs["llama"][1]
    bare = tmp_path / "bare"  # the model's tensors, written without the session's objects
    save(
        bare,
        1,
        {
            f"params/{n.replace('.', '/')}": t.detach().numpy()
            for n, t in model.state_dict().items()
        },
    )
    assert main(["export", str(bare), "--format", "hf", "-o", str(tmp_path / "x")]) == 2
    assert "no model config" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--config PATH"):
        dstt.open(bare).at(1).export(tmp_path / "x", "hf")
    model.config.save_pretrained(tmp_path / "cfg")
    assert (
        main(
            [
                "export",
                str(bare),
                "--format",
                "hf",
                "-o",
                str(tmp_path / "x"),
                "--config",
                str(tmp_path / "cfg"),
            ]
        )
        == 0
    )
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "x")
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=IDS).logits, model.eval()(input_ids=IDS).logits)


def test_a_run_stored_with_wrapper_prefixes_opens_under_plain_names(
    runs: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    model = runs["llama"][1]
    compiled = torch.compile(model, backend="eager")
    old = tmp_path / "old"  # what capture wrote for a compiled model before it dropped them
    arrays = {
        f"params/{n.replace('.', '/')}": t.detach().numpy()
        for n, t in compiled.state_dict().items()
    }
    assert all("/_orig_mod/" in p for p in arrays)
    for step in (1, 2):
        save(old, step, arrays)
    run = dstt.open(old)
    snap = run.at(2)
    assert "model.norm.weight" in snap.names()
    assert not any("_orig_mod" in n for n in snap.names())
    assert _same(snap.tensor("norm.weight"), model.model.norm.weight.detach())
    assert _same(snap.tensor("_orig_mod.model.norm.weight"), model.model.norm.weight.detach())
    assert run.trajectory("layers.1.mlp.up_proj.weight").sizes["step"] == 2
    assert snap.layer("layers.*.mlp")["model/layers/0/mlp/up_proj/weight"].shape == (32, 16)
    snap.export(tmp_path / "old.safetensors")
    assert "model.norm.weight" in load_file(tmp_path / "old.safetensors")
    torch.manual_seed(9)
    plain = _llama()
    snap.load_into(plain)
    assert all(
        torch.equal(a, b)
        for a, b in zip(plain.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_fused_experts_are_named_and_one_expert_is_selected(
    runs: dict[str, tuple[Path, Any]],
) -> None:
    path, model = runs["mixtral"]
    snap = dstt.open(path).at(3)
    gate_up = snap.tensor("layers.0.mlp.experts.gate_up_proj")
    down = snap.tensor("layers.0.mlp.experts.down_proj")
    assert down.dims == ("expert", "out_features", "in_features")
    assert gate_up.dims[0] == "expert"  # its other dims: sized otherwise, named apart
    assert gate_up.sizes["expert"] == 3
    assert snap.tensor("layers.0.input_layernorm.weight").dims == ("normalized_shape",)
    tree = snap.layer("experts.0")  # expert 0 of each layer's fused experts, not all of them
    for i in (0, 1):
        node = tree[f"model/layers/{i}/mlp/experts"]
        assert int(node["expert"]) == 0
        assert node["gate_up_proj"].dims == gate_up.dims[1:]
        want = model.get_parameter(f"model.layers.{i}.mlp.experts.gate_up_proj")[0]
        assert _same(node["gate_up_proj"], want.detach())
    one = snap.layer("layers.1.mlp.experts.2.down_proj")
    node = one["model/layers/1/mlp/experts"]
    assert list(node.data_vars) == ["down_proj"]
    assert int(node["expert"]) == 2
    assert _same(node["down_proj"], model.model.layers[1].mlp.experts.down_proj[2].detach())
    with pytest.raises(TensorNotFoundError, match=r"holds 3 experts \(0 … 2\), not expert 3"):
        snap.layer("experts.3")


def test_hf_dims_by_module_class(runs: dict[str, tuple[Path, Any]]) -> None:
    snap = dstt.open(runs["gpt2"][0]).at(3)
    assert snap.tensor("h.0.attn.c_attn.weight").dims == ("in_features", "out_features")
    assert snap.tensor("h.0.attn.c_attn.bias").dims == ("out_features",)
    llama = dstt.open(runs["llama"][0]).at(3)
    assert llama.tensor("model.norm.weight").dims == ("normalized_shape",)
