"""The kernels of a bfloat16 model (products on the packed tiles, on whichever path this process
takes: test_bfloat16_products.py runs each; the skinny kernel on bfloat16 weights, paged
attention over a bfloat16 cache, rotary embedding, RMSNorm, SiLU-and-mul, KV stores) against
float32 math on the same bfloat16 values, or against torch's own bfloat16 reference."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops

from .cases import needs_native, random_paged_batch, relative_error
from .test_fused import gelu_tanh_and_mul_float64, merged_qkv, q_and_k_views, rope_tables


def assert_rounded_from(actual: torch.Tensor, exact: torch.Tensor) -> None:
    """`actual` (bfloat16) is `exact` (float32) rounded to bfloat16, to within one step of
    bfloat16 (its 8 bits of precision: 2^-8 relative) where the float32 sums, added in another
    order, sit next to a rounding boundary."""
    assert actual.dtype == torch.bfloat16 and actual.shape == exact.shape
    bound = exact.abs() * 2**-7 + 1e-6 * exact.abs().max()
    assert bool(((actual.float() - exact).abs() <= bound).all())


@needs_native
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 17, 33, 64, 256])
@pytest.mark.parametrize(
    ("n", "k"), [(70, 33), (16, 64), (33, 577), (130, 64)], ids=["odd", "one-panel", "wide", "tall"]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_linear_rounds_the_float32_product(
    rows: int, n: int, k: int, with_bias: bool
) -> None:
    """Odd panel counts, K past whole tile steps, rows past whole tiles of x (AMX's 16 and 32,
    the dot products' 6), panels past whole groups of the dot products' 4."""
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    out = ops._NATIVE.bfloat16_linear(x, ops._NATIVE.pack_bfloat16_weight(weight), n, bias)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert_rounded_from(out, exact)


@needs_native
def test_bfloat16_linear_gives_a_row_the_same_bits_at_any_batch_size() -> None:
    """Each row's sums take the same steps whatever rows share its tile: decode outputs do not
    depend on what else is in the batch."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(100, 96, generator=gen).bfloat16()
    packed = ops._NATIVE.pack_bfloat16_weight(weight)
    x = torch.randn(40, 96, generator=gen).bfloat16()
    together = ops._NATIVE.bfloat16_linear(x, packed, 100, None)
    for row in (0, 17, 39):
        alone = ops._NATIVE.bfloat16_linear(x[row : row + 1], packed, 100, None)
        assert torch.equal(alone[0], together[row])


@needs_native
def test_bfloat16_linear_reads_rows_of_a_wider_tensor_where_they_lie() -> None:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(50, 40, generator=gen).bfloat16()
    packed = ops._NATIVE.pack_bfloat16_weight(weight)
    wide = torch.randn(7, 64, generator=gen).bfloat16()
    rows = wide[:, 8:48]  # row stride 64, not 40
    assert torch.equal(
        ops._NATIVE.bfloat16_linear(rows, packed, 50, None),
        ops._NATIVE.bfloat16_linear(rows.contiguous(), packed, 50, None),
    )


@needs_native
def test_bfloat16_linear_rejects_a_weight_it_did_not_pack() -> None:
    weight = torch.randn(40, 64).bfloat16()
    packed = ops._NATIVE.pack_bfloat16_weight(weight)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops._NATIVE.bfloat16_linear(torch.randn(2, 64).bfloat16(), packed, 20, None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops._NATIVE.bfloat16_linear(torch.randn(2, 16).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="must come from pack_bfloat16_weight"):
        ops._NATIVE.bfloat16_linear(torch.randn(2, 64).bfloat16(), weight, 40, None)


@needs_native
def test_linear_runs_a_bfloat16_weight_on_its_packed_tiles_up_to_their_bound() -> None:
    """Up to BFLOAT16_PREPACKED_MAX_ROWS (every width on the widening path), else torch's GEMM."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(48, 40, generator=gen).bfloat16()
    bias = torch.randn(48, generator=gen).bfloat16()
    prepacked = ops.prepack_linear_weight(weight, 64)
    assert prepacked is not None and prepacked.dtype == torch.bfloat16
    x = torch.randn(2, 3, 40, generator=gen).bfloat16()
    out = ops.linear(x, weight, bias, prepacked)
    assert out.shape == (2, 3, 48)
    assert torch.equal(
        out.view(6, 48), ops._NATIVE.bfloat16_linear(x.view(6, 40), prepacked, 48, bias)
    )
    bound = ops.BFLOAT16_PREPACKED_MAX_ROWS
    wide = torch.randn(min(bound, 2 * ops.PREPACKED_MAX_ROWS) + 1, 40, generator=gen).bfloat16()
    tiles = ops._NATIVE.bfloat16_linear(wide, prepacked, 48, bias)
    expected = tiles if wide.shape[0] <= bound else F.linear(wide, weight, bias)
    assert torch.equal(ops.linear(wide, weight, bias, prepacked), expected)


@needs_native
@pytest.mark.parametrize("k", [1, 7, 8, 9, 64, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_skinny_linear_is_the_float32_product_of_the_widened_weight(
    k: int, with_bias: bool
) -> None:
    gen = torch.Generator().manual_seed(k)
    for m in range(1, 6):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen) if with_bias else None
        out = ops._NATIVE.linear(x, weight, bias)
        assert relative_error(out, F.linear(x, weight.float(), bias)) < 1e-5, (m, n)


@needs_native
def test_linear_without_packed_tiles_streams_a_bfloat16_weight_through_the_skinny_kernel() -> None:
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(70, 33, generator=gen).bfloat16()
    x = torch.randn(1, ops.BFLOAT16_SKINNY_MAX_ROWS, 33, generator=gen).bfloat16()
    out = ops.linear(x, weight)  # no packed copy, as on a CPU with neither AMX nor AVX512-BF16
    assert_rounded_from(out, F.linear(x.float(), weight.float()))
    wide = torch.randn(ops.BFLOAT16_SKINNY_MAX_ROWS + 1, 33, generator=gen).bfloat16()
    assert torch.equal(ops.linear(wide, weight), F.linear(wide, weight))


@needs_native
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(9, 3, None), (4, 2, 17), (8, 1, None)])
@pytest.mark.parametrize("longest", [190, 1500], ids=["one-partition", "three-partitions"])
def test_paged_attention_reads_a_bfloat16_cache_in_place(
    heads: int, kv_heads: int, window: int | None, longest: int
) -> None:
    torch.manual_seed(heads)
    q, kv_cache, tables, lens = random_paged_batch(
        [1, 15, 16, 17, 33, 100, longest] * 2, heads, kv_heads
    )
    q, kv_cache = q.bfloat16(), kv_cache.bfloat16()
    out = ops.paged_decode_attention(q, kv_cache, tables, lens, 0.125, window)
    exact = ops.paged_decode_attention_reference(
        q.float(), kv_cache.float(), tables, lens, 0.125, window
    )
    assert_rounded_from(out, exact)


@needs_native
@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_native_rotary_rotates_bfloat16_heads_in_float32_and_rounds_once(tokens: int) -> None:
    """Strided q and k views of a bfloat16 qkv, float32 tables: the float32 rotation of the same
    values, rounded to bfloat16; v untouched. ops.rotary_embedding takes this kernel too."""
    torch.manual_seed(tokens)
    heads, kv_heads, head_dim = 9, 3, 64
    cos, sin = rope_tables(2048, head_dim)
    positions = torch.randint(0, 2048, (tokens,))
    qkv = merged_qkv(tokens, heads, kv_heads, head_dim).bfloat16()
    exact = qkv.float()
    ops.rotary_embedding_reference(
        positions, *q_and_k_views(exact, heads, kv_heads, head_dim), cos, sin
    )
    through_ops = qkv.clone()
    ops._NATIVE.rotary_embedding(
        positions, *q_and_k_views(qkv, heads, kv_heads, head_dim), cos, sin
    )
    ops.rotary_embedding(
        positions, *q_and_k_views(through_ops, heads, kv_heads, head_dim), cos, sin
    )
    v_start = (heads + kv_heads) * head_dim
    assert_rounded_from(qkv[:, :v_start], exact[:, :v_start])
    assert torch.equal(qkv[:, v_start:].float(), exact[:, v_start:])
    assert torch.equal(through_ops, qkv)


def assert_bfloat16_close(actual: torch.Tensor, expected: torch.Tensor, min_equal: float) -> None:
    """Both bfloat16: every element within one bfloat16 step of the other (float32 sums in
    another order can round the other way at a boundary), and at least `min_equal` of them
    bit-identical."""
    assert actual.dtype == expected.dtype == torch.bfloat16 and actual.shape == expected.shape
    step = expected.float().abs() * 2**-7 + 1e-30
    assert bool(((actual.float() - expected.float()).abs() <= step).all())
    assert (actual.view(torch.int16) == expected.view(torch.int16)).float().mean() >= min_equal


@needs_native
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("dim", [576, 61])
def test_bfloat16_add_rms_norm_rounds_where_torch_rounds(rows: int, dim: int) -> None:
    """The residual sum rounds once as `add_` rounds it (the same bits), the output once after
    the weight as torch's rms_norm rounds it; rows of 576 (SmolLM2) and 61 (a tail of 5)."""
    torch.manual_seed(rows + dim)
    x = (torch.randn(rows, dim) * 3).bfloat16()
    residual = torch.randn(rows, dim).bfloat16()
    weight = (torch.rand(dim) * 2).bfloat16()
    native_residual, reference_residual = residual.clone(), residual.clone()
    normed, new_residual = ops.add_rms_norm(x, native_residual, weight, 1e-5)
    expected, _ = ops.add_rms_norm_reference(x, reference_residual, weight, 1e-5)
    assert new_residual is native_residual
    assert torch.equal(native_residual, reference_residual)
    assert_bfloat16_close(normed, expected, min_equal=0.99)
    alone, _ = ops.add_rms_norm(x, None, weight, 1e-5)
    assert_bfloat16_close(alone, ops.add_rms_norm_reference(x, None, weight, 1e-5)[0], 0.99)


@needs_native
@pytest.mark.parametrize("width", [1536, 13])
def test_bfloat16_silu_and_mul_rounds_the_activation_before_the_product(width: int) -> None:
    torch.manual_seed(width)
    x = (torch.randn(9, 2 * width) * 4).bfloat16()
    assert_bfloat16_close(ops.silu_and_mul(x), ops.silu_and_mul_reference(x), min_equal=0.99)


@needs_native
@pytest.mark.parametrize("width", [2048, 13])
def test_bfloat16_gelu_tanh_and_mul_rounds_the_activation_before_the_product(width: int) -> None:
    """Against float64 rounded where torch rounds (torch's own float32 tanh-GELU cancels for
    gates below about -4, so its bits differ there)."""
    torch.manual_seed(width)
    x = (torch.randn(9, 2 * width) * 4).bfloat16()
    gate, up = x.chunk(2, dim=-1)
    ones = torch.ones_like(gate)
    activation = gelu_tanh_and_mul_float64(torch.cat((gate, ones), dim=-1)).bfloat16()
    expected = (activation.float() * up.float()).bfloat16()
    assert_bfloat16_close(ops.gelu_tanh_and_mul(x), expected, min_equal=0.99)


@needs_native
def test_bfloat16_store_kv_copies_strided_heads_into_their_slots() -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = merged_qkv(5, heads, kv_heads, head_dim).bfloat16()
    k, v = (
        qkv[:, start : start + kv_heads * head_dim].view(5, kv_heads, head_dim)
        for start in (heads * head_dim, (heads + kv_heads) * head_dim)
    )
    slots = torch.tensor([3, 17, 0, 40, 41])
    native = torch.zeros(2, 4, 16, kv_heads, head_dim, dtype=torch.bfloat16)
    expected = native.clone()
    ops.store_kv(native, slots, k, v)
    ops.store_kv_reference(expected, slots, k, v)
    assert torch.equal(native, expected)


@needs_native
def test_paged_attention_takes_a_bfloat16_query_and_rounds_its_output_once() -> None:
    """A bfloat16 query gives the float32 query's output (it widens exactly), rounded once."""
    torch.manual_seed(5)
    q, kv_cache, tables, lens = random_paged_batch([1, 16, 17, 90], 9, 3)
    q, kv_cache = q.bfloat16(), kv_cache.bfloat16()
    out = ops._NATIVE.paged_decode_attention(q, kv_cache, tables, lens, 0.125, 0)
    widened = ops._NATIVE.paged_decode_attention(q.float(), kv_cache, tables, lens, 0.125, 0)
    assert out.dtype == torch.bfloat16 and torch.equal(out, widened.bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16 with a bfloat16 or 8-bit cache"):
        ops._NATIVE.paged_decode_attention(q, kv_cache.float(), tables, lens, 0.125, 0)
