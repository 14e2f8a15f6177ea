"""Prefill attention on AMX tiles (csrc/prefill_attention.cpp) and on FMAs
(csrc/prefill_attention_fma.cpp) against torch's SDPA in float32: causal over the last n of S
positions, grouped heads, sliding windows, partial tiles of keys and positions; the FMA kernel's
AVX2 path against its AVX-512 one; and the dispatch that sends everything else to SDPA."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenmill.kernels import attention, ops

needs_amx = pytest.mark.skipif(
    not ops.amx_available(), reason="this CPU or OS does not run AMX tiles"
)
needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)


def merged_qkv(
    n: int, s: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as a model has them: views of one merged projection output, q the last n rows."""
    generator = torch.Generator().manual_seed(n * 7919 + s)
    merged = torch.randn(s, heads + 2 * kv_heads, dim, generator=generator).to(dtype)
    q, k, v = merged.split([heads, kv_heads, kv_heads], dim=1)
    return q[s - n :], k, v


@needs_amx
@pytest.mark.parametrize(
    ("n", "s", "heads", "kv_heads", "dim", "window"),
    [
        (1, 1, 9, 3, 64, 0),
        (5, 5, 9, 3, 64, 0),
        (16, 16, 9, 3, 64, 0),
        (157, 157, 9, 3, 64, 0),  # SmolLM2's heads, a batch64-sized prompt
        (33, 100, 9, 3, 64, 0),  # a chunk after cached context
        (256, 700, 9, 3, 64, 0),
        (100, 100, 4, 1, 256, 0),  # Gemma 3 270M's heads
        (300, 300, 4, 1, 256, 64),  # ... on a local layer
        (77, 500, 4, 1, 256, 37),
        (40, 40, 2, 2, 32, 5),
        (64, 64, 4, 2, 128, 0),
    ],
)
def test_native_prefill_attention_matches_float32_sdpa(
    n: int, s: int, heads: int, kv_heads: int, dim: int, window: int
) -> None:
    q, k, v = merged_qkv(n, s, heads, kv_heads, dim)
    scale = dim**-0.5
    out = ops._NATIVE.prefill_attention(q, k, v, scale, window)
    wide = (t.float() for t in (q, k, v))
    expected = ops.prefill_attention_reference(*wide, scale, window or None)
    assert out.dtype == torch.bfloat16 and out.shape == (n, heads, dim)
    # The weights round to bfloat16 before their product with V, as torch's bfloat16 kernel
    # rounds them, and the output rounds once: about a bfloat16 step of values near 1.
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_amx
@pytest.mark.parametrize("window", [0, 50])
def test_a_prompt_in_chunks_gets_the_bits_of_the_whole_prompt(window: int) -> None:
    """A position's keys go through the same 32-key blocks, in the same order, whatever chunk
    the position comes in: chunked prefill computes the very bits of an unchunked one."""
    q, k, v = merged_qkv(300, 300, 9, 3, 64)
    whole = ops._NATIVE.prefill_attention(q, k, v, 0.125, window)
    chunks = [(0, 37), (37, 160), (160, 161), (161, 300)]
    parts = [ops._NATIVE.prefill_attention(q[a:b], k[:b], v[:b], 0.125, window) for a, b in chunks]
    assert torch.equal(torch.cat(parts), whole)


@needs_amx
def test_prefill_attention_takes_bfloat16_heads_on_amx() -> None:
    q, k, v = merged_qkv(50, 80, 9, 3, 64)
    assert torch.equal(
        ops.prefill_attention(q, k, v, 0.125, 20), ops._NATIVE.prefill_attention(q, k, v, 0.125, 20)
    )


# (n, s, heads, kv_heads, dim, window): SmolLM2's heads fresh and after cached context, one
# position, Gemma 3 270M's heads on full and local layers, head dims with a tail of lanes.
FMA_CASES = [
    (1, 1, 9, 3, 64, 0),
    (1, 50, 9, 3, 64, 0),
    (5, 5, 9, 3, 64, 0),
    (157, 157, 9, 3, 64, 0),
    (33, 100, 9, 3, 64, 0),
    (200, 600, 9, 3, 64, 0),
    (100, 100, 4, 1, 256, 0),
    (130, 130, 4, 1, 256, 64),
    (77, 300, 4, 1, 256, 37),
    (40, 40, 2, 2, 32, 5),
    (17, 23, 2, 1, 5, 3),
    (31, 31, 6, 2, 80, 0),
]


@needs_native
@pytest.mark.parametrize(("n", "s", "heads", "kv_heads", "dim", "window"), FMA_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fma_prefill_attention_matches_float32_sdpa(
    dtype: torch.dtype, n: int, s: int, heads: int, kv_heads: int, dim: int, window: int
) -> None:
    q, k, v = merged_qkv(n, s, heads, kv_heads, dim, dtype)
    scale = dim**-0.5
    out = ops._NATIVE.prefill_attention_fma(q, k, v, scale, window)
    wide = (t.float() for t in (q, k, v))
    expected = ops.prefill_attention_reference(*wide, scale, window or None)
    assert out.dtype == dtype and out.shape == (n, heads, dim)
    # float32 throughout: only the order of the sums differs. A bfloat16 output rounds once.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@needs_native
@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fma_prefill_of_a_prompt_in_chunks_gets_the_bits_of_the_whole_prompt(
    dtype: torch.dtype, window: int
) -> None:
    q, k, v = merged_qkv(300, 300, 9, 3, 64, dtype)
    whole = ops._NATIVE.prefill_attention_fma(q, k, v, 0.125, window)
    chunks = [(0, 37), (37, 160), (160, 161), (161, 300)]
    parts = [
        ops._NATIVE.prefill_attention_fma(q[a:b], k[:b], v[:b], 0.125, window) for a, b in chunks
    ]
    assert torch.equal(torch.cat(parts), whole)


# FMA_CASES through the FMA kernel in float32 and bfloat16, saved to argv[1].
FMA_SCRIPT = """
import sys, torch
from tokenmill.kernels import ops
from tests.kernels.test_prefill_attention import FMA_CASES, merged_qkv
outputs = []
for dtype in (torch.float32, torch.bfloat16):
    for n, s, heads, kv_heads, dim, window in FMA_CASES:
        q, k, v = merged_qkv(n, s, heads, kv_heads, dim, dtype)
        outputs.append(ops._NATIVE.prefill_attention_fma(q, k, v, dim**-0.5, window))
torch.save(outputs, sys.argv[1])
"""


@needs_native
def test_fma_prefill_attention_avx2_path_gives_the_avx512_paths_bits(tmp_path: Path) -> None:
    """Both paths do each lane's arithmetic in the same order: the AVX2 build (8 lanes), in a
    process of its own, gives the bits of this process's path (16 lanes where the CPU has
    AVX-512; on a CPU without it both are AVX2 and the test shows nothing, but passes)."""
    env = {**os.environ, "TOKENMILL_AVX512": "0"}
    root = Path(__file__).parents[2]
    path = tmp_path / "avx2.pt"
    subprocess.run([sys.executable, "-c", FMA_SCRIPT, str(path)], env=env, cwd=root, check=True)
    avx2 = torch.load(path)
    index = 0
    for dtype in (torch.float32, torch.bfloat16):
        for n, s, heads, kv_heads, dim, window in FMA_CASES:
            q, k, v = merged_qkv(n, s, heads, kv_heads, dim, dtype)
            here = ops._NATIVE.prefill_attention_fma(q, k, v, dim**-0.5, window)
            assert torch.equal(avx2[index], here)
            index += 1


@needs_native
@pytest.mark.parametrize(
    ("dtype", "dim"),
    [(torch.float32, 64), (torch.bfloat16, 48), (torch.bfloat16, 64)],
)
def test_prefill_attention_runs_float32_and_bfloat16_heads_natively(
    dtype: torch.dtype, dim: int
) -> None:
    q, k, v = merged_qkv(20, 30, 4, 2, dim, dtype)
    assert torch.equal(
        ops.prefill_attention(q, k, v, 0.2, 7), ops._NATIVE.prefill_attention(q, k, v, 0.2, 7)
    )


@needs_native
def test_prefill_attention_without_amx_runs_on_fmas() -> None:
    if ops.amx_available():
        pytest.skip("this CPU runs a bfloat16 model's prefill attention on AMX tiles")
    q, k, v = merged_qkv(20, 30, 4, 2, 64)
    assert torch.equal(
        ops._NATIVE.prefill_attention(q, k, v, 0.2, 0),
        ops._NATIVE.prefill_attention_fma(q, k, v, 0.2, 0),
    )


@pytest.mark.parametrize(
    ("dtype", "dim"),
    [(torch.float16, 64), (torch.float32, 288)],  # a dtype and a head_dim the kernels lack
)
def test_prefill_attention_leaves_what_the_kernels_do_not_take_to_sdpa(
    dtype: torch.dtype, dim: int
) -> None:
    q, k, v = merged_qkv(20, 30, 4, 2, dim, dtype)
    assert torch.equal(
        ops.prefill_attention(q, k, v, 0.2),
        ops.prefill_attention_reference(q, k, v, 0.2),
    )


def test_prefill_attention_switched_to_sdpa_runs_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention, "NATIVE_PREFILL_ATTENTION", False)
    q, k, v = merged_qkv(20, 30, 4, 2, 64, torch.float32)
    assert torch.equal(
        ops.prefill_attention(q, k, v, 0.2, 9),
        ops.prefill_attention_reference(q, k, v, 0.2, 9),
    )


@needs_amx
def test_native_prefill_attention_rejects_what_it_cannot_take() -> None:
    q, k, v = merged_qkv(20, 30, 4, 2, 64)
    with pytest.raises(RuntimeError, match="q's positions must be the last of k's"):
        ops._NATIVE.prefill_attention(q, k[:10], v[:10], 0.2, 0)
    with pytest.raises(RuntimeError, match="multiple of k's"):
        ops._NATIVE.prefill_attention(q[:, :3], k, v, 0.2, 0)


@needs_native
def test_fma_prefill_attention_rejects_what_it_cannot_take() -> None:
    q, k, v = merged_qkv(20, 30, 4, 2, 288, torch.float32)
    with pytest.raises(RuntimeError, match="head_dim must be at most 256"):
        ops._NATIVE.prefill_attention_fma(q, k, v, 0.2, 0)
    q, k, v = merged_qkv(20, 30, 4, 2, 64, torch.float32)
    with pytest.raises(RuntimeError, match="q's positions must be the last of k's"):
        ops._NATIVE.prefill_attention_fma(q, k[:10], v[:10], 0.2, 0)
    with pytest.raises(RuntimeError, match="of q's dtype"):
        ops._NATIVE.prefill_attention_fma(q, k.bfloat16(), v, 0.2, 0)
    with pytest.raises(RuntimeError, match="multiple of k's"):
        ops._NATIVE.prefill_attention_fma(q[:, :3], k, v, 0.2, 0)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops._NATIVE.prefill_attention_fma(q.half(), k.half(), v.half(), 0.2, 0)
