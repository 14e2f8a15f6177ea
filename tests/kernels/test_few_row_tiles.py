"""The few-rows tiles (TOKENMILL_FEW_ROW_TILES) of the packed float32 and bfloat16 products: every
output takes the same FMAs in the same order of k as on the baseline tiles and on the AVX2 ones,
so each setting gives the same bits. Each setting runs in a process of its own (the library picks
its tiles once as it loads). On a CPU without AVX-512 all three run the AVX2 tiles and the tests
show nothing, but still pass."""

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

# Packed products at every row count of the few-rows tiles and a few past them, with N that ends
# inside a panel and inside a group of panels, with and without a bias; saved to argv[1].
PRODUCTS = """
import sys, torch
from tokenmill.kernels import ops
native = ops._NATIVE
gen = torch.Generator().manual_seed(0)
outputs = []
for n, k in ((70, 33), (129, 200)):
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = native.pack_linear_weight(weight)
    packed16 = native.pack_bfloat16_weight(weight.bfloat16())
    for rows in range(1, 18):
        x = torch.randn(rows, k, generator=gen)
        outputs.append(native.packed_linear(x, packed, n, bias if rows % 2 else None))
        outputs.append(native.bfloat16_linear(x.bfloat16(), packed16, n, bias.bfloat16()))
torch.save(outputs, sys.argv[1])
"""


@pytest.fixture(scope="module")
def products(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The products under each setting: few-rows tiles, the baseline tiles, the AVX2 tiles."""
    directory = tmp_path_factory.mktemp("few_row_tiles")
    settings = {
        "few_rows": {"TOKENMILL_FEW_ROW_TILES": "1"},
        "baseline": {"TOKENMILL_FEW_ROW_TILES": "0"},
        "avx2": {"TOKENMILL_AVX512": "0"},
    }
    runs = {}
    for name, setting in settings.items():
        env = {**os.environ, "TOKENMILL_BF16_PRODUCTS": "widen", **setting}
        env.setdefault("OMP_NUM_THREADS", "1")
        path = Path(directory) / f"{name}.pt"
        subprocess.run([sys.executable, "-c", PRODUCTS, str(path)], env=env, check=True)
        runs[name] = torch.load(path)
    return runs


@needs_native
def test_few_row_tiles_give_the_baseline_tiles_bits(products: dict[str, Any]) -> None:
    assert len(products["few_rows"]) == len(products["baseline"]) == 2 * 17 * 2
    for few, baseline in zip(products["few_rows"], products["baseline"], strict=True):
        assert torch.equal(few, baseline)


@needs_native
def test_few_row_tiles_give_the_avx2_tiles_bits(products: dict[str, Any]) -> None:
    for few, avx2 in zip(products["few_rows"], products["avx2"], strict=True):
        assert torch.equal(few, avx2)
