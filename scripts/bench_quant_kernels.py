"""How fast the native linear kernels stream their weights: bytes per second, per weight format.

Cycles x (1..64 rows) through SmolLM2-shaped matrices (qkv, o, gate_up, down) totalling about
256 MB, far more than the L3 cache, so every product reads its weights from DRAM, as decode
does. Prints bytes read per second, best of a few passes. Run it alone on the machine:

    OMP_NUM_THREADS=2 .venv/bin/python scripts/bench_quant_kernels.py --rows 1,4,16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from tokenmill.kernels import ops

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one decoder layer
FORMATS = ["fp32", "fp8", "int8", "q8_0", "int4", "int4-g128"]

Product = Callable[[torch.Tensor], torch.Tensor]


def packed_product(fmt: str, n: int, k: int, gen: torch.Generator) -> tuple[Product, int]:
    """A product x -> x W^T with random weights in `fmt`, and the bytes it reads."""
    if fmt == "fp32":
        weight = torch.randn(n, k, generator=gen)
        return (lambda x: ops.linear(x, weight)), weight.nbytes
    if fmt == "fp8":
        codes = torch.randint(0, 0x7F, (n, k), dtype=torch.uint8, generator=gen)
        codes ^= torch.randint(0, 2, (n, k), dtype=torch.uint8, generator=gen) << 7  # signs
        fp8, scales = codes.view(torch.float8_e4m3fn), torch.rand(n, generator=gen) / 100
        return (lambda x: ops.fp8_linear(x, fp8, scales)), codes.nbytes + scales.nbytes
    if fmt in ("int8", "q8_0"):
        group = -(-k // 32) * 32 if fmt == "int8" else 32
        dtype = torch.float32 if fmt == "int8" else torch.float16
        qweight = torch.randint(-127, 128, (n, -(-k // 32) * 32), dtype=torch.int8, generator=gen)
        scales = torch.rand(n, -(-k // group), generator=gen).to(dtype) / 100
        panels = ops.pack_int8_panels(qweight, scales)
        return (lambda x: ops.int8_linear(x, qweight, scales, group, None, panels)), (
            qweight.nbytes + scales.nbytes
        )
    group = 128 if fmt == "int4-g128" else 32
    qweight = torch.randint(0, 256, (n, -(-k // 64) * 32), dtype=torch.uint8, generator=gen)
    scales = torch.rand(n, -(-k // group), generator=gen).half() / 100
    mins = -scales * 8
    nbytes = qweight.nbytes + scales.nbytes + mins.nbytes
    panels = ops.pack_int4_panels(qweight, scales, mins, k)
    return (lambda x: ops.int4_linear(x, qweight, scales, mins, group, None, panels)), nbytes


def stream_rate(fmt: str, rows: int, total_bytes: float, passes: int) -> float:
    gen = torch.Generator().manual_seed(0)
    products, nbytes = [], 0
    while nbytes < total_bytes:
        n, k = SHAPES[len(products) % len(SHAPES)]
        product, size = packed_product(fmt, n, k, gen)
        products.append((product, torch.randn(rows, k, generator=gen)))
        nbytes += size
    best = float("inf")
    for _ in range(passes + 1):  # the first pass warms up
        start = time.perf_counter()
        for product, x in products:
            product(x)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--rows", default="1", help="comma-separated rows of x, each <= 64")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--total-mb", type=float, default=256.0)
    parser.add_argument("--passes", type=int, default=5)
    args = parser.parse_args()
    print(f"kernels: {ops.backend()}, threads: {torch.get_num_threads()}")
    print(f"{'format':<10} {'rows':>4} {'GB/s':>7}")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for fmt in args.formats.split(","):
                rate = stream_rate(fmt, rows, args.total_mb * 1e6, args.passes)
                print(f"{fmt:<10} {rows:>4} {rate:>7.1f}", flush=True)


if __name__ == "__main__":
    main()
