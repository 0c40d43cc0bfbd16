"""Dimension names from module types (``dstt.engine.state.dims``), made placeable for xarray
(``dstt.inspect.naming.resolve_dims``), and carried by the store's flat layout and zarr.json."""

from __future__ import annotations

import pytest
import torch

from dstt.engine.state.dims import ModelDims, array_dims, model_dims
from dstt.inspect.naming import tensor_dims
from dstt.schema import resolve_dims
from dstt.store.format.flat import FlatLayout
from dstt.store.format.layout import plan_chunks
from dstt.store.format.zarr_meta import array_document


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.fc = torch.nn.Linear(4, 3)
        self.ln = torch.nn.LayerNorm(3)
        self.ln2 = torch.nn.LayerNorm((2, 3), bias=False)
        self.conv = torch.nn.Conv2d(2, 5, (3, 2))
        self.conv1 = torch.nn.Conv1d(2, 5, 3, bias=False)
        self.up = torch.nn.ConvTranspose2d(5, 2, 3)
        self.bn = torch.nn.BatchNorm1d(6)
        self.scale = torch.nn.Parameter(torch.ones(7, 2))


def test_module_types_name_their_tensors() -> None:
    dims = model_dims(Net())
    assert dims["emb.weight"] == ("num_embeddings", "embedding_dim")
    assert dims["fc.weight"] == ("out_features", "in_features")
    assert dims["fc.bias"] == ("out_features",)
    assert dims["ln.weight"] == dims["ln.bias"] == ("normalized_shape",)
    assert dims["ln2.weight"] == ("normalized_shape_0", "normalized_shape_1")
    assert dims["conv.weight"] == ("out_channels", "in_channels", "kernel_h", "kernel_w")
    assert dims["conv.bias"] == ("out_channels",)
    assert dims["conv1.weight"] == ("out_channels", "in_channels", "kernel_w")
    assert dims["up.weight"] == ("in_channels", "out_channels", "kernel_h", "kernel_w")
    assert dims["bn.running_mean"] == dims["bn.weight"] == ("num_features",)
    assert dims["bn.num_batches_tracked"] == ()
    assert "scale" not in dims  # a bare parameter: nothing says what its dims are


def test_arrays_of_a_step_get_their_parameters_dims() -> None:
    net = Net()
    shapes = {f"params/{n.replace('.', '/')}": tuple(p.shape) for n, p in net.named_parameters()}
    shapes.update(
        {
            "optim/exp_avg/fc/weight": (3, 4),
            "optim/exp_avg_sq/emb/weight": (11, 4),
            "optim/step/fc/weight": (),
            "optim/exp_avg/fc/bias": (1, 3),
            "buffers/bn/num_batches_tracked": (),
            "extra/table": (2, 2),
        }
    )
    dims = ModelDims(net)(shapes)
    assert dims["optim/exp_avg/fc/weight"] == ("out_features", "in_features")
    assert dims["optim/exp_avg_sq/emb/weight"] == ("num_embeddings", "embedding_dim")
    assert dims["optim/step/fc/weight"] == ()  # 0-d: none
    assert dims["params/scale"] == ("dim0", "dim1")  # readable fallback
    # not the parameter's shape: fallback names, which the root's scale (7, 2) holds already
    assert dims["optim/exp_avg/fc/bias"] == ("dim0_bias", "dim1_bias")
    assert dims["extra/table"] == ("dim0_table", "dim1")  # dim1 is 2 there too: shared
    assert dims["params/fc/bias"] == dims["params/fc/weight"][:1]  # shared: same size


def test_a_name_is_never_used_for_two_sizes_in_a_node_or_below_it() -> None:
    got = resolve_dims(
        {
            "params/a/weight": (("out_features", "in_features"), (3, 4)),
            "params/a/bias": (("out_features",), (3,)),
            "params/a/gate": (("out_features",), (5,)),  # same node, other size
            "params/top": (("dim0",), (9,)),  # root node: an ancestor of every node
            "params/a/b/scale": (("dim0", "dim1"), (2, 9)),
            "optim/exp_avg/a/weight": (("out_features", "in_features"), (3, 4)),
        }
    )
    assert got["params/a/bias"] == ("out_features",)
    assert got["params/a/weight"] == ("out_features", "in_features")
    assert got["params/a/gate"] == ("out_features_gate",)
    assert got["params/top"] == ("dim0",)
    assert got["params/a/b/scale"] == ("dim0_scale", "dim1")  # 2 != 9 above it; dim1 free
    assert got["optim/exp_avg/a/weight"] == ("out_features", "in_features")


class _Rec:
    def __init__(self, shape: tuple[int, ...], dims: tuple[str, ...] | None) -> None:
        self.shape, self.dims = shape, dims


def test_inspection_uses_stored_dims_and_keeps_old_names_without() -> None:
    stored = {
        "params/fc/weight": _Rec((3, 4), ("out_features", "in_features")),
        "params/fc/bias": _Rec((3,), ("out_features",)),
        "params/v": _Rec((2,), None),
    }
    dims = tensor_dims(stored)
    assert dims("params/fc/weight", 2) == ("out_features", "in_features")
    assert dims("params/v", 1) == ("dim0",)
    old = tensor_dims({"params/fc/weight": _Rec((3, 4), None)})  # written before dims
    assert old("params/fc/weight", 2) == ("weight_0", "weight_1")


def test_flat_layout_and_zarr_json_carry_the_dims() -> None:
    plan = plan_chunks((3, 4), 4, 1 << 20)
    layout = FlatLayout.build(
        [
            ("params/fc/weight", "float32", plan, ("out_features", "in_features")),
            ("params/x", "float32", plan),
        ]
    )
    assert layout.arrays[0].dims == ("out_features", "in_features")
    assert layout.arrays[1].dims is None
    doc = array_document("params/fc/weight", "float32", plan, dims=layout.arrays[0].dims)
    assert doc["dimension_names"] == ["out_features", "in_features"]
    assert array_document("params/x", "float32", plan)["dimension_names"] == ["x_0", "x_1"]
    for bad in (("a",), ("a", "a"), ("a", "b c")):
        with pytest.raises(ValueError, match="distinct identifiers"):
            array_document("params/x", "float32", plan, dims=bad)


def test_array_dims_without_a_model_falls_back() -> None:
    assert array_dims({"params/w": (2, 3), "params/s": ()}, {}) == {
        "params/w": ("dim0", "dim1"),
        "params/s": (),
    }


class LlamaRMSNorm(torch.nn.Module):  # transformers' classes, known by name only
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(6))


class Conv1D(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6, 18))  # (nx, nf): a Linear's, transposed
        self.bias = torch.nn.Parameter(torch.zeros(18))


class MoeExperts(torch.nn.Module):
    def __init__(self, is_transposed: bool | None) -> None:
        super().__init__()
        self.num_experts = 4
        if is_transposed is not None:
            self.is_transposed = is_transposed
        self.gate_up_proj = torch.nn.Parameter(torch.zeros(4, 10, 6))
        self.down_proj = torch.nn.Parameter(torch.zeros(4, 6, 5))
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(4, 6))


class HfLike(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = LlamaRMSNorm()
        self.c_attn = Conv1D()
        self.experts = MoeExperts(False)
        self.t_experts = MoeExperts(True)
        self.u_experts = MoeExperts(None)


def test_transformers_modules_are_named_by_class_name() -> None:
    dims = model_dims(torch.compile(HfLike(), backend="eager"))  # canonical names, too
    assert dims["norm.weight"] == ("normalized_shape",)
    assert dims["c_attn.weight"] == ("in_features", "out_features")
    assert dims["c_attn.bias"] == ("out_features",)
    assert dims["experts.gate_up_proj"] == ("expert", "out_features", "in_features")
    assert dims["experts.down_proj_bias"] == ("expert", "out_features")
    assert dims["t_experts.down_proj"] == ("expert", "in_features", "out_features")
    assert dims["u_experts.down_proj"] == ("expert", "dim1", "dim2")  # layout unknown
