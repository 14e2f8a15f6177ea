"""The AVX-512 paths (the packed float32 tile two panels wide, the VNNI integer dot products) give
the AVX2 kernels' bits. The library picks its path once as it loads, so each side runs in a
process of its own, with TOKENMILL_AVX512=0 for AVX2. On a CPU without AVX-512 both sides run
AVX2 and the test shows nothing, but still passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import ops

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)

# Products at 1-64 rows (and a ragged 13) of the int4 and int8 panel kernels and the packed
# float32 kernel, with outputs that are not a whole number of panels, saved to argv[1].
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
packed = ops.prepack_linear_weight(weight, 64)
outputs = []
for rows in (1, 2, 3, 4, 13, 16, 64):
    x = torch.randn(rows, 200, generator=gen)
    outputs.append(ops.int4_linear(x, qweight4, scales, mins, 32, bias))
    outputs.append(ops.int8_linear(x, qweight8, scales, 32, bias))
    outputs.append(ops.linear(x, weight, bias, packed))
torch.save(outputs, sys.argv[1])
"""


def _products(path: Path, avx512: str) -> list[torch.Tensor]:
    env = {**os.environ, "TOKENMILL_AVX512": avx512}
    subprocess.run([sys.executable, "-c", PRODUCTS, str(path)], env=env, check=True)
    return torch.load(path)


@needs_native
def test_avx512_paths_give_the_avx2_kernels_bits(tmp_path: Path) -> None:
    avx2 = _products(tmp_path / "avx2.pt", "0")
    avx512 = _products(tmp_path / "avx512.pt", "1")
    assert len(avx2) == len(avx512) == 21
    for a, b in zip(avx2, avx512, strict=True):
        assert torch.equal(a, b)
