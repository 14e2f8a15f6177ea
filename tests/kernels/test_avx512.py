"""The AVX-512 paths against the AVX2 kernels. The packed float32 tile two panels wide, the VNNI
integer dot products and the 16-lane gated activations and RMSNorm give the AVX2 kernels' bits;
paged decode attention, which adds its sums
in another order on each path, matches the torch reference on both. The library picks its path
once as it loads, so each side runs in a process of its own, with TOKENMILL_AVX512=0 for AVX2.
On a CPU without AVX-512 both sides run AVX2 and the tests show nothing, but still pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill.kernels import ops

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)

# Products at 1-64 rows (and a ragged 13) of the int4, int8 and Q5_0 panel kernels and the packed
# float32 kernel, with outputs that are not a whole number of panels; then SwiGLU's and GeGLU's
# activations and the fused add + RMSNorm in float32 and bfloat16, at widths with and without a
# 16-lane tail and at the model's own, gates reaching both saturated ends; saved to argv[1].
PRODUCTS = """
import sys, torch
from tokenmill.kernels import ops
gen = torch.Generator().manual_seed(0)
weight = torch.randn(100, 200, generator=gen) * 0.05
bias = torch.randn(100, generator=gen)
qweight4 = torch.randint(0, 256, (100, 128), generator=gen, dtype=torch.uint8)  # nibble pairs
scales = torch.rand(100, 7, generator=gen).half() * 0.01
mins = -torch.rand(100, 7, generator=gen).half() * 0.1
qweight8 = torch.randint(-127, 128, (100, 224), generator=gen, dtype=torch.int8)
qhigh = torch.randint(0, 256, (100, 28), generator=gen, dtype=torch.uint8)  # Q5_0's fifth bits
packed = ops.prepack_linear_weight(weight, 64)
outputs = []
for rows in (1, 2, 3, 4, 13, 16, 64):
    x = torch.randn(rows, 200, generator=gen)
    outputs.append(ops.int4_linear(x, qweight4, scales, mins, 32, bias))
    outputs.append(ops.int8_linear(x, qweight8, scales, 32, bias))
    outputs.append(ops.q5_0_linear(x, qweight4, qhigh, scales, bias))
    outputs.append(ops.linear(x, weight, bias, packed))
for dtype in (torch.float32, torch.bfloat16):
    for rows, width in ((1, 1536), (13, 577), (64, 13), (3, 8)):
        gate_up = (torch.randn(rows, 2 * width, generator=gen) * 30).to(dtype)
        outputs.append(ops.silu_and_mul(gate_up))
        outputs.append(ops.gelu_tanh_and_mul(gate_up))
        x, residual = (torch.randn(rows, width, generator=gen).to(dtype) for _ in range(2))
        norm_weight = torch.randn(width, generator=gen).to(dtype)
        outputs.extend(ops.add_rms_norm(x, residual, norm_weight, 1e-5))
        outputs.append(ops.add_rms_norm(x, None, norm_weight, 1e-5)[0])
torch.save(outputs, sys.argv[1])
"""


# Decode attention over float32, bfloat16, int8 and fp8 caches for groups of 3, 8 (two runs of
# the AVX-512 path's 4 heads), 1 and 5 query heads, head dims of 64, 256, 80 and 48 (columns in
# runs of 64 and of 16), 7 sequences (a work item per KV head) and 14 (per sequence), with and
# without a sliding window, with and without a key mask (a draft tree's); inputs and outputs
# saved to argv[1].
ATTENTION = """
import sys, torch
from tokenmill.kernels import ops
gen = torch.Generator().manual_seed(0)
native = ops._NATIVE
cases = []
for heads, kv_heads, dim, copies in ((9, 3, 64, 1), (9, 3, 64, 2), (8, 1, 256, 1), (6, 6, 80, 2),
                                     (5, 1, 48, 1)):
    lens = torch.tensor([1, 15, 16, 17, 33, 100, 190] * copies)
    blocks = -(-lens // 16)
    tables = torch.randperm(int(blocks.sum()), generator=gen).view(1, -1)
    tables = torch.nn.utils.rnn.pad_sequence(tables[0].split(blocks.tolist()), batch_first=True)
    cache = torch.randn(2, int(blocks.sum()), 16, kv_heads, dim, generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    codes = {dtype: ops.quantize_kv_reference(cache, dtype)
             for dtype in (torch.int8, torch.float8_e4m3fn)}
    tree_mask = torch.rand(len(lens), 6, generator=gen) < 0.5
    tree_mask[:, -1] = True
    for window, mask in ((0, None), (17, None), (0, tree_mask), (17, tree_mask)):
        outputs = {
            "float32": native.paged_decode_attention(q, cache, tables, lens, 0.125, window, mask),
            "bfloat16": native.paged_decode_attention(
                q.bfloat16(), cache.bfloat16(), tables, lens, 0.125, window, mask),
        }
        for dtype, (values, scales) in codes.items():
            outputs[str(dtype)] = native.paged_decode_attention_quantized(
                q, values, scales, tables, lens, 0.125, window, mask)
        cases.append((q, cache, codes, tables, lens, window, mask, outputs))
torch.save(cases, sys.argv[1])
"""


def _run(script: str, path: Path, avx512: str) -> Any:
    env = {**os.environ, "TOKENMILL_AVX512": avx512}
    subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True)
    return torch.load(path)


@needs_native
def test_avx512_paths_give_the_avx2_kernels_bits(tmp_path: Path) -> None:
    avx2 = _run(PRODUCTS, tmp_path / "avx2.pt", "0")
    avx512 = _run(PRODUCTS, tmp_path / "avx512.pt", "1")
    assert len(avx2) == len(avx512) == 28 + 2 * 4 * 5
    for a, b in zip(avx2, avx512, strict=True):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize("avx512", ["0", "1"], ids=["avx2", "avx512"])
def test_both_attention_paths_match_the_reference(tmp_path: Path, avx512: str) -> None:
    cases = _run(ATTENTION, tmp_path / "attention.pt", avx512)
    assert len(cases) == 20
    for q, cache, codes, tables, lens, window, mask, outputs in cases:
        exact = ops.paged_decode_attention_reference(q, cache, tables, lens, 0.125, window, mask)
        assert (outputs["float32"] - exact).abs().max().item() < 1e-5
        # A bfloat16 query and cache, widened exactly, give the float32 result rounded once.
        widened = ops.paged_decode_attention_reference(
            q.bfloat16().float(), cache.bfloat16().float(), tables, lens, 0.125, window, mask
        )
        rounding = widened.abs() * 2.0**-8 + 1e-6
        assert ((outputs["bfloat16"].float() - widened).abs() <= rounding).all()
        for dtype, (values, scales) in codes.items():
            expected = ops.paged_decode_attention_quantized_reference(
                q, values, scales, tables, lens, 0.125, window, mask
            )
            assert (outputs[str(dtype)] - expected).abs().max().item() < 1e-5
