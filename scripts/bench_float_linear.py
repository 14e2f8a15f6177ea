"""How fast the packed float32 and bfloat16 products stream their weights at a few rows of x.

Builds SmolLM2-135M's products (30 layers of qkv, o, gate_up, down and the lm_head; about 540 MB
in float32, more than the L3 cache) as packed copies, runs them in the model's order at each row
count and prints, per product shape, the weight bytes read per second (best of a few passes).
A speculative verify step and a decode of a few streams multiply by 2-32 rows; ideally each
streams as fast as one row does. Run it alone on the machine:

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_float_linear.py --rows 1,2,4,8,9,16,17,32
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from tokenmill.kernels import ops

LAYERS = 30
LAYER_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LM_HEAD = (49152, 576)


def packed_products(dtype: torch.dtype) -> list[tuple[str, int, int, torch.Tensor]]:
    """(name, n, k, packed copy) for every product of one forward pass, in the model's order."""
    gen = torch.Generator().manual_seed(0)
    products = []
    for _ in range(LAYERS):
        for name, (n, k) in LAYER_SHAPES.items():
            weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
            products.append((name, n, k, ops.prepack_linear_weight(weight, 16)))
    weight = (torch.randn(*LM_HEAD, generator=gen) * 0.05).to(dtype)
    products.append(("lm_head", *LM_HEAD, ops.prepack_linear_weight(weight, 16)))
    return products


def stream_rates(products, rows: int, dtype: torch.dtype, passes: int) -> dict[str, float]:
    """GB/s of weight read per product name, from each name's summed time in the best pass."""
    native = ops._NATIVE
    kernel = native.packed_linear if dtype == torch.float32 else native.bfloat16_linear
    gen = torch.Generator().manual_seed(rows)
    inputs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, _, k, _ in products}
    element = torch.finfo(dtype).bits // 8
    best: dict[str, float] = {}
    for _ in range(passes + 1):  # the first pass warms up
        seconds: dict[str, float] = defaultdict(float)
        for name, n, k, packed in products:
            start = time.perf_counter()
            kernel(inputs[k], packed, n, None)
            seconds[name] += time.perf_counter() - start
        total = sum(seconds.values())
        if total < best.get("all", float("inf")):
            best = dict(seconds, all=total)
    nbytes: dict[str, float] = defaultdict(float)
    for name, n, k, _ in products:
        nbytes[name] += n * k * element
    nbytes["all"] = sum(nbytes.values())
    return {name: nbytes[name] / best[name] / 1e9 for name in best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,9,16,17,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    print(f"kernels: {ops.backend()}, threads: {torch.get_num_threads()}")
    names = [*LAYER_SHAPES, "lm_head", "all"]
    with torch.inference_mode():
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            products = packed_products(dtype)
            print(f"\n{dtype_name} GB/s  " + " ".join(f"{name:>8}" for name in names))
            for rows in (int(r) for r in args.rows.split(",")):
                rates = stream_rates(products, rows, dtype, args.passes)
                print(f"{rows:>4} rows      " + " ".join(f"{rates[n]:8.1f}" for n in names))
            del products


if __name__ == "__main__":
    main()
