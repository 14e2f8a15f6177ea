"""The NF4 kernels against their torch reference (dequantize, then an fp32 product), on the AVX2
and the AVX-512 path, and as the decode loop's linear."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import ops
from tokenmill.quant.nf4 import Nf4Linear

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)

# N not a multiple of the kernel's 4 rows, K not a multiple of 64 (a padded last group).
OUT_FEATURES, IN_FEATURES = 70, 200


def nf4_layer(group_size: int = 64, k: int = IN_FEATURES, seed: int = 0) -> Nf4Linear:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(OUT_FEATURES, k, generator=gen) * 0.05
    return Nf4Linear.from_float(weight, torch.randn(OUT_FEATURES, generator=gen), group_size)


def reference(layer: Nf4Linear, x: torch.Tensor) -> torch.Tensor:
    return ops.nf4_linear_reference(x, *layer.weight_tensors(), layer.group_size, layer.bias)


@needs_native
def test_native_dequantization_is_the_reference() -> None:
    layer = nf4_layer(group_size=128)
    expected = ops.dequantize_nf4_reference(*layer.weight_tensors(), 128, IN_FEATURES)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=1e-6, atol=0)


@needs_native
@pytest.mark.parametrize("rows", [1, 4, 64])
@pytest.mark.parametrize("group_size", [64, 128])
def test_kernel_matches_the_reference(rows: int, group_size: int) -> None:
    layer = nf4_layer(group_size, seed=rows)
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows))
    second = layer.second_level()
    native = ops._NATIVE.nf4_linear(x, layer.qweight, layer.qabsmax, second, group_size, layer.bias)
    torch.testing.assert_close(native, reference(layer, x), rtol=1e-5, atol=1e-5)
    # The op: the kernel up to NF4_KERNEL_MAX_ROWS rows, dequantized tiles beyond.
    torch.testing.assert_close(layer(x), reference(layer, x), rtol=1e-5, atol=1e-5)


def test_torch_backend_runs_the_reference(torch_ops) -> None:
    layer = nf4_layer()
    x = torch.randn(2, IN_FEATURES)
    assert torch.equal(layer(x), reference(layer, x))
    assert layer.native_kernel() is None


@needs_native
def test_decode_loop_takes_nf4_layers() -> None:
    layer = nf4_layer()
    kernel = layer.native_kernel()
    assert kernel.kind == "nf4"
    assert ops.linear_kernel_max_rows(kernel) == ops.NF4_KERNEL_MAX_ROWS


@needs_native
def test_kernel_refuses_a_mismatched_weight() -> None:
    layer = nf4_layer()
    x = torch.randn(1, IN_FEATURES)
    with pytest.raises(RuntimeError, match="qabsmax must be"):
        ops._NATIVE.nf4_linear(
            x, layer.qweight, layer.qabsmax[:, :1], layer.second_level(), 64, None
        )


# Products at 1, 3, 4 and 64 rows, with the layer's arguments, saved to argv[1].
PRODUCTS = """
import sys, torch
from tokenmill.kernels import ops
from tokenmill.quant.nf4 import Nf4Linear
gen = torch.Generator().manual_seed(0)
layer = Nf4Linear.from_float(torch.randn(70, 200, generator=gen) * 0.05, None, 64)
cases = []
for rows in (1, 3, 4, 64):
    x = torch.randn(rows, 200, generator=gen)
    out = ops._NATIVE.nf4_linear(x, layer.qweight, layer.qabsmax, layer.second_level(), 64, None)
    cases.append((x, out))
torch.save((layer.state_dict(), cases), sys.argv[1])
"""


@needs_native
@pytest.mark.parametrize("avx512", ["0", "1"], ids=["avx2", "avx512"])
def test_both_simd_paths_match_the_reference(tmp_path: Path, avx512: str) -> None:
    path = tmp_path / "nf4.pt"
    env = {**os.environ, "TOKENMILL_AVX512": avx512}
    subprocess.run([sys.executable, "-c", PRODUCTS, str(path)], env=env, check=True)
    state, cases = torch.load(path)
    layer = Nf4Linear(200, 70, False, 64)
    layer.load_state_dict(state)
    for x, out in cases:
        torch.testing.assert_close(out, reference(layer, x), rtol=1e-5, atol=1e-5)
