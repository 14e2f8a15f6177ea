"""Rotary embedding details that the real model does not exercise."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.nn import functional as F

from tokenmill.model.layers import (
    Linear,
    RotaryEmbedding,
    prepack_linears,
    rope_inverse_frequencies,
)
from tokenmill.quant.int8 import Int8Linear

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama3_scaling_keeps_high_and_slows_low_frequencies():
    plain = rope_inverse_frequencies(128, 500000.0, None)
    scaled = rope_inverse_frequencies(128, 500000.0, LLAMA3_SCALING)
    wavelen = 2 * math.pi / plain
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    assert torch.equal(scaled[high], plain[high])
    assert torch.allclose(scaled[low], plain[low] / 8.0)
    middle = ~(high | low)
    assert torch.all((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8.0))


def test_linear_scaling_divides_every_frequency():
    plain = rope_inverse_frequencies(64, 10000.0, None)
    scaled = rope_inverse_frequencies(64, 10000.0, {"type": "linear", "factor": 4.0})
    assert torch.allclose(scaled, plain / 4.0)


def test_unknown_scaling_is_rejected_by_name():
    with pytest.raises(ValueError, match="yarn"):
        rope_inverse_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_rotation_preserves_norm_and_position_zero_is_identity():
    rope = RotaryEmbedding(64, 32, 10000.0)
    q = torch.randn(5, 4, 64)
    k = torch.randn(5, 2, 64)
    rq, rk = q.clone(), k.clone()
    rope(torch.tensor([0, 3, 7, 12, 31]), rq, rk)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.equal(rq[0], q[0]) and torch.equal(rk[0], k[0])
    assert not torch.allclose(rq[1:], q[1:])


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_prepack_keeps_one_packed_copy_of_each_float_linear():
    linear, quantized = Linear(16, 48), Int8Linear.from_float(torch.randn(8, 48))
    model = torch.nn.Sequential(linear, quantized)
    x = torch.randn(40, 16)  # wider than the skinny kernels: the prepacked path
    plain = model(x)
    prepack_linears(model, 64)
    packed = linear.prepacked
    assert packed is not None and not hasattr(quantized, "prepacked")
    assert not any("prepacked" in name for name in model.state_dict())
    torch.testing.assert_close(model(x), plain)
    prepack_linears(model, 64)
    assert linear.prepacked is packed  # a second engine on the same model reuses it
    with torch.no_grad():
        linear.weight.mul_(2)
    prepack_linears(model, 64)  # packed again from the changed weight
    torch.testing.assert_close(linear(x), F.linear(x, linear.weight, linear.bias))
    copied = copy.deepcopy(model)  # the copy leaves the packed weight behind
    assert copied[0].prepacked is None and linear.prepacked is not None
    prepack_linears(model, None)
    assert linear.prepacked is None
