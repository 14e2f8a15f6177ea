"""How fast the native paged decode attention reads each KV dtype: milliseconds per call.

One decode step's attention for a batch of sequences (SmolLM2's 9 query heads over 3 KV heads,
head_dim 64) through shuffled block tables, with fp32, bf16 (a bfloat16 model's query too), int8
and fp8 caches. The dtypes take turns, so a slow spell on a shared machine hits them alike;
prints the median of the turns, per call. Each dtype has one cache, which may stay in a large L3;
`--layers 30` gives it SmolLM2's 30, read in turn as a model's layers read theirs, from DRAM.
`--scale-max` bounds the 8-bit caches' token scales (uniform below it): at 1 their scores span
hundreds and most softmax weights underflow, the case where a weight times its token's scale
once came out a denormal.

    .venv/bin/python scripts/bench_attention_kernels.py --batch 64 --tokens 290 --threads 1
    .venv/bin/python scripts/bench_attention_kernels.py --batch 1 --tokens 8192 --layers 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from tokenmill.kernels import ops

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


def attention_calls(
    batch: int, tokens: int, scale_max: float, layers: int
) -> dict[str, Callable[[int], torch.Tensor]]:
    """Each dtype's call of one layer (an index below `layers`) over that layer's cache."""
    gen = torch.Generator().manual_seed(0)
    per_sequence = -(-tokens // BLOCK_SIZE)
    blocks = batch * per_sequence
    tables = torch.randperm(blocks, generator=gen).view(batch, per_sequence).int()
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    q16 = q.bfloat16()
    shape = (2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    fp32 = [torch.randn(shape, generator=gen) for _ in range(layers)]
    bf16 = [cache.bfloat16() for cache in fp32]
    scales = torch.rand(shape[:-1], generator=gen) * scale_max
    int8 = [torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen) for _ in range(layers)]
    fp8 = [(cache * 100).to(torch.float8_e4m3fn) for cache in fp32]
    scale = HEAD_DIM**-0.5
    return {
        "fp32": lambda i: ops.paged_decode_attention(q, fp32[i], tables, lens, scale),
        "bf16": lambda i: ops.paged_decode_attention(q16, bf16[i], tables, lens, scale),
        "int8": lambda i: ops.paged_decode_attention_quantized(
            q, int8[i], scales, tables, lens, scale
        ),
        "fp8": lambda i: ops.paged_decode_attention_quantized(
            q, fp8[i], scales, tables, lens, scale
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=290, help="context length of each sequence")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--scale-max", type=float, default=0.01, help="8-bit caches' scales")
    parser.add_argument("--layers", type=int, default=1, help="caches per dtype, read in turn")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    calls = attention_calls(args.batch, args.tokens, args.scale_max, args.layers)
    times: dict[str, list[float]] = {name: [] for name in calls}
    repeats = max(1, 5 // args.layers)
    with torch.inference_mode():
        for _ in range(args.turns):
            for name, call in calls.items():
                call(0)  # warm
                start = time.perf_counter()
                for _ in range(repeats):
                    for layer in range(args.layers):
                        call(layer)
                times[name].append((time.perf_counter() - start) / (repeats * args.layers) * 1e3)
    print(
        f"kernels: {ops.backend()}, threads: {args.threads}, B={args.batch} x {args.tokens}, "
        f"{args.layers} layer(s)"
    )
    for name, values in times.items():
        print(f"{name:<5} {statistics.median(values):7.3f} ms")


if __name__ == "__main__":
    main()
