"""The swap that installs quantized linears, and rebuilding one from its recorded format."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.linear import (
    empty_quant_linear,
    prepare_quant_linears,
    quant_linear_formats,
    replace_linears,
)


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.proj = Linear(64, 32, bias=True)
        self.head = Linear(64, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as SmolLM2's head is


def test_replacing_linears_leaves_other_modules_and_tied_weights_alone() -> None:
    model = TwoLayers()
    embedding = model.embed.weight
    replace_linears(model, lambda name, lin: Int4Linear.from_float(lin.weight, lin.bias, 32))
    assert isinstance(model.proj, Int4Linear) and isinstance(model.head, Int4Linear)
    assert model.embed.weight is embedding
    assert quant_linear_formats(model) == {
        "proj": {"kind": "int4", "group_size": 32},
        "head": {"kind": "int4", "group_size": 32},
    }


def test_a_recorded_format_rebuilds_an_empty_layer_of_the_same_shape() -> None:
    layer = empty_quant_linear({"kind": "int4", "group_size": 64}, Linear(100, 7, bias=True))
    assert isinstance(layer, Int4Linear) and layer.group_size == 64
    assert layer.qweight.shape == (7, 64) and layer.bias is not None
    assert torch.count_nonzero(layer.qweight) == 0


def test_unknown_layer_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="kind 'int2' is unknown"):
        empty_quant_linear({"kind": "int2"}, Linear(8, 8, bias=False))


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear])
def test_the_kernels_copy_follows_a_checkpoint_loaded_into_the_layer(kind: type) -> None:
    """The native kernels read a regrouped copy of the weights (`panels`): loading other weights
    into the layer must remake it, and it never becomes part of the checkpoint."""
    gen = torch.Generator().manual_seed(0)
    layer = kind.from_float(torch.randn(24, 64, generator=gen))
    other = kind.from_float(torch.randn(24, 64, generator=gen))
    x = torch.randn(2, 64, generator=gen)
    with torch.no_grad():
        assert not torch.equal(layer(x), other(x))  # the copy exists and is in use
        layer.load_state_dict(other.state_dict())
        assert torch.equal(layer(x), other(x))
    assert (
        set(layer.state_dict())
        == set(other.state_dict())
        == {"qweight", "scales"} | ({"mins"} if kind is Int4Linear else set())
    )


@pytest.mark.parametrize("kind", [Int4Linear, Int8Linear])
def test_prepare_makes_the_kernels_copy_before_the_first_product(
    kind: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine prepares every quantized layer at start, so no request pays for the packing."""
    if ops.backend() != "native":
        pytest.skip("only the native kernels read the panels")
    name = "pack_int4_panels" if kind is Int4Linear else "pack_int8_panels"
    packs = []
    pack = getattr(ops, name)
    monkeypatch.setattr(ops, name, lambda *args: packs.append(1) or pack(*args))
    model = nn.Sequential(kind.from_float(torch.randn(24, 64)), nn.ReLU())
    prepare_quant_linears(model)
    assert len(packs) == 1
    with torch.no_grad():
        model(torch.randn(1, 64))
    assert len(packs) == 1
