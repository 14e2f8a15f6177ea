"""How fast a bfloat16 model's prompt attention runs: the AMX kernel against torch's SDPA.

One layer's attention (SmolLM2's 9 query heads over 3 KV heads, head_dim 64, or `--heads`,
`--kv-heads`, `--head-dim`) for prompts of several lengths, a chunk after cached context and a
sliding window, then for the 64 prompts of the batch64 workload one after another, as the engine
calls it. The two take turns; prints the best of the turns in milliseconds, the rate of
floating-point operations that makes, and each one's largest error against SDPA in float32.

    .venv/bin/python scripts/bench_prefill_attention.py --turns 5
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time
from collections.abc import Callable

import torch

from tokenmill.bench.workloads import batch64
from tokenmill.kernels import ops

# (new positions, context positions, window; 0: none)
CASES = [
    (157, 157, 0),
    (256, 256, 0),
    (1024, 1024, 0),
    (2048, 2048, 0),
    (2048, 2048, 512),
    (256, 2048, 0),
    (4096, 4096, 0),
    (8192, 8192, 0),
]


Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, int], torch.Tensor]
KERNELS: dict[str, Kernel] = {
    "native": lambda q, k, v, scale, window: ops._NATIVE.prefill_attention(q, k, v, scale, window),
    "sdpa": lambda q, k, v, scale, window: ops.prefill_attention_reference(
        q, k, v, scale, window or None
    ),
}

Shape = tuple[int, int, int]  # query heads, KV heads, head_dim


def best_ms(calls: dict[str, Callable[[], object]], turns: int, repeats: int) -> dict[str, float]:
    """Each call's best time of `turns`, in milliseconds; the calls take turns, so a slow spell
    on a shared machine hits them alike."""
    for call in calls.values():
        call()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(turns):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(repeats):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / repeats * 1e3)
    return best


def merged_qkv(s: int, shape: Shape, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """q, k and v of s positions as views of one merged projection output, as a model has them."""
    heads, kv_heads, dim = shape
    qkv = torch.randn(s, heads + 2 * kv_heads, dim, generator=gen).bfloat16()
    return qkv.split([heads, kv_heads, kv_heads], dim=1)


def time_case(n: int, s: int, window: int, shape: Shape, turns: int, gen: torch.Generator) -> str:
    heads, _, dim = shape
    scale = dim**-0.5
    q, k, v = merged_qkv(s, shape, gen)
    q = q[s - n :]
    calls = {
        name: functools.partial(kernel, q, k, v, scale, window) for name, kernel in KERNELS.items()
    }
    wide = (t.float() for t in (q, k, v))
    expected = ops.prefill_attention_reference(*wide, scale, window or None)
    flops = 4 * heads * dim * (n * min(window, s) if window else n * s - n * n / 2)
    times = best_ms(calls, turns, repeats=max(2, int(2e7 / (n * s))))
    line = [f"n={n:5d} S={s:5d} window={window:3d}:"]
    for name, call in calls.items():
        ms = times[name]
        error = (call().float() - expected).abs().max().item()
        line.append(f"{name} {ms:8.3f} ms ({flops / ms / 1e9:.2f} TFLOP/s, error {error:.4f})")
    return "  ".join(line)


def time_batch64(shape: Shape, turns: int, gen: torch.Generator) -> str:
    """The batch64 workload's 64 prompts, one call each, as the engine makes them."""
    lengths = [len(request.prompt_token_ids or ()) for request in batch64()]
    bounds = [0, *itertools.accumulate(lengths)]
    q, k, v = merged_qkv(bounds[-1], shape, gen)
    scale = shape[2] ** -0.5
    segments = list(itertools.pairwise(bounds))

    def each_prompt(kernel: Kernel) -> Callable[[], object]:
        return lambda: [kernel(q[a:b], k[a:b], v[a:b], scale, 0) for a, b in segments]

    times = best_ms({name: each_prompt(kernel) for name, kernel in KERNELS.items()}, turns, 3)
    return f"batch64's 64 prompts ({bounds[-1]} tokens), one layer: " + ", ".join(
        f"{name} {ms:.2f} ms" for name, ms in times.items()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    if not ops.amx_available():
        raise SystemExit("this CPU or OS does not run AMX tiles: the native kernel cannot run")
    shape = (args.heads, args.kv_heads, args.head_dim)
    gen = torch.Generator().manual_seed(0)
    for n, s, window in CASES:
        print(time_case(n, s, window, shape, args.turns, gen))
    print(time_batch64(shape, args.turns, gen))


if __name__ == "__main__":
    main()
