"""Prefill attention on AMX tiles (csrc/prefill_attention.cpp) against torch's SDPA in float32:
causal over the last n of S positions, grouped heads, sliding windows, partial tiles of keys
and positions; and the dispatch that sends everything else to SDPA."""

import pytest
import torch

from tokenmill.kernels import ops

needs_amx = pytest.mark.skipif(
    not ops.amx_available(), reason="this CPU or OS does not run AMX tiles"
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


@pytest.mark.parametrize(
    ("dtype", "dim"),
    [(torch.float32, 64), (torch.bfloat16, 48)],  # float32; a head_dim not a multiple of 32
)
def test_prefill_attention_leaves_what_the_tiles_do_not_take_to_sdpa(
    dtype: torch.dtype, dim: int
) -> None:
    q, k, v = merged_qkv(20, 30, 4, 2, dim, dtype)
    assert torch.equal(
        ops.prefill_attention(q, k, v, 0.2),
        ops.prefill_attention_reference(q, k, v, 0.2),
    )


@needs_amx
def test_native_prefill_attention_rejects_what_it_cannot_take() -> None:
    q, k, v = merged_qkv(20, 30, 4, 2, 48)
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 32"):
        ops._NATIVE.prefill_attention(q, k, v, 0.2, 0)
    q, k, v = merged_qkv(20, 30, 4, 2, 64)
    with pytest.raises(RuntimeError, match="q's positions must be the last of k's"):
        ops._NATIVE.prefill_attention(q, k[:10], v[:10], 0.2, 0)
    with pytest.raises(RuntimeError, match="must be bfloat16"):
        ops._NATIVE.prefill_attention(q.float(), k, v, 0.2, 0)
    with pytest.raises(RuntimeError, match="multiple of k's"):
        ops._NATIVE.prefill_attention(q[:, :3], k, v, 0.2, 0)
