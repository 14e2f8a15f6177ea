"""The quantized KV cache's kernels: native store and paged decode attention against their torch
references (int8 and fp8, GQA, odd lengths, block boundaries, sliding windows), and the rounding
error quantization itself allows."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.kernels import ops

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)
CODE_DTYPES = [pytest.param(torch.int8, id="int8"), pytest.param(torch.float8_e4m3fn, id="fp8")]
# Native dequantizes inside the online softmax, the reference before one SDPA: the same values,
# summed in another order, so they differ by fp32 rounding only.
ATTENTION_MAX_ABS_ERROR = 1e-5


def quantized_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of random normal K and V in every slot, as the store writes them."""
    x = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    return ops.quantize_kv_reference(x, dtype)


def random_quantized_batch(
    seq_lens: list[int],
    heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    head_dim: int = 64,
    block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, codes, scales (with spare blocks), shuffled block tables and lengths."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5
    values, scales = quantized_cache(num_blocks, block_size, kv_heads, head_dim, dtype)
    shuffled = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.long)
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = torch.tensor([shuffled.pop() for _ in range(count)])
    q = torch.randn(len(seq_lens), heads, head_dim)
    return q, values, scales, tables, torch.tensor(seq_lens)


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_int8_and_fp8_round_trips_stay_within_their_rounding_error(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 4, 64) * torch.rand(50, 4, 1) * 10
    codes, scales = ops.quantize_kv_reference(x, dtype)
    assert codes.dtype == dtype and scales.shape == (50, 4)
    error = (ops.dequantize_kv_reference(codes, scales) - x).abs()
    max_abs = x.abs().amax(dim=-1, keepdim=True)
    if dtype == torch.int8:  # half a step of max|x| / 127, plus fp32 rounding
        bound = max_abs / 254 * (1 + 1e-5)
    else:  # e4m3's 3 mantissa bits: 1/16 relative, or half its smallest subnormal (2^-10)
        bound = x.abs() / 16 + max_abs / 448 * 2**-10 + 1e-6
    assert (error <= bound).all()
    assert torch.equal(scales, max_abs.squeeze(-1) / ops.KV_CODE_MAX[dtype])


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_a_head_of_zeros_gets_zero_codes_and_scale(dtype: torch.dtype) -> None:
    codes, scales = ops.quantize_kv_reference(torch.zeros(3, 2, 8), dtype)
    assert not codes.float().any() and not scales.any()


STORE_BACKENDS = [
    pytest.param(ops.store_kv_quantized_reference, id="reference"),
    pytest.param(
        lambda *args: ops._NATIVE.store_kv_quantized(*args), id="native", marks=needs_native
    ),
]


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("store", STORE_BACKENDS)
def test_store_quantizes_each_token_head_into_exactly_its_slot(store, dtype: torch.dtype) -> None:
    """k and v are column slices of one merged projection, as the model hands them over."""
    torch.manual_seed(9)
    kv_heads, head_dim, block_size, tokens = 2, 13, 4, 5
    values, scales = quantized_cache(6, block_size, kv_heads, head_dim, dtype)
    before_values, before_scales = values.clone(), scales.clone()
    slots = torch.tensor([13, 2, 7, 23, 0])
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim) * 3
    _, k, v = (t.view(tokens, kv_heads, head_dim) for t in qkv.split(kv_heads * head_dim, -1))
    store(values, scales, slots, k, v)

    flat_values = values.view(torch.uint8).view(2, -1, kv_heads, head_dim)
    flat_scales = scales.view(2, -1, kv_heads)
    for half, x in enumerate((k, v)):
        codes, x_scales = ops.quantize_kv_reference(x, dtype)
        assert torch.equal(flat_values[half, slots], codes.view(torch.uint8))
        assert torch.equal(flat_scales[half, slots], x_scales)
    untouched = torch.ones(6 * block_size, dtype=torch.bool)
    untouched[slots] = False
    before = before_values.view(torch.uint8).view(2, -1, kv_heads, head_dim)
    assert torch.equal(flat_values[:, untouched], before[:, untouched])
    assert torch.equal(flat_scales[:, untouched], before_scales.view(2, -1, kv_heads)[:, untouched])


@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("store", STORE_BACKENDS)
def test_a_bfloat16_models_keys_are_quantized_as_their_float32_values(
    store, dtype: torch.dtype
) -> None:
    """A bfloat16 k or v widens exactly, so it gets the codes and scales of its float32 copy."""
    torch.manual_seed(4)
    values, scales = quantized_cache(3, 4, 2, 64, dtype)
    expected_values, expected_scales = values.clone(), scales.clone()
    slots = torch.tensor([5, 0, 11])
    k, v = (torch.randn(3, 2, 64).bfloat16() for _ in range(2))
    store(values, scales, slots, k, v)
    ops.store_kv_quantized_reference(expected_values, expected_scales, slots, k.float(), v.float())
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scales, expected_scales)


@needs_native
@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_a_bfloat16_query_over_codes_gives_the_float32_querys_output_rounded_once(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(6)
    q, values, scales, tables, lens = random_quantized_batch([1, 16, 17, 90], 9, 3, dtype)
    q = q.bfloat16()
    out = ops.paged_decode_attention_quantized(q, values, scales, tables, lens, 0.125)
    widened = ops._NATIVE.paged_decode_attention_quantized(
        q.float(), values, scales, tables, lens, 0.125, 0
    )
    assert out.dtype == torch.bfloat16 and torch.equal(out, widened.bfloat16())
    reference = ops.paged_decode_attention_quantized_reference(
        q, values, scales, tables, lens, 0.125
    )
    exact = ops.paged_decode_attention_quantized_reference(
        q.float(), values, scales, tables, lens, 0.125
    )
    assert torch.equal(reference, exact.bfloat16())
    assert ((out.float() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()


@needs_native
def test_native_quantized_store_rejects_slots_outside_the_cache() -> None:
    values, scales = quantized_cache(3, 4, 1, 8, torch.int8)
    k = torch.zeros(1, 1, 8)
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.store_kv_quantized(values, scales, torch.tensor([12]), k, k)


@needs_native
@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(6, 6), (9, 3), (8, 1)], ids=["mha", "gqa3", "all-to-one"]
)
@pytest.mark.parametrize("batch", [1, 7, 40])
def test_native_quantized_decode_matches_reference(
    dtype: torch.dtype, heads: int, kv_heads: int, batch: int
) -> None:
    torch.manual_seed(batch * heads)
    edge_lens = [15, 16, 17, 1, 32, 33, 100]  # around block boundaries, then multi-block
    seq_lens = [
        edge_lens[i] if i < len(edge_lens) else random.randint(1, 200) for i in range(batch)
    ]
    q, values, scales, tables, lens = random_quantized_batch(seq_lens, heads, kv_heads, dtype)
    scale = q.shape[-1] ** -0.5
    out = ops._NATIVE.paged_decode_attention_quantized(q, values, scales, tables, lens, scale)
    expected = ops.paged_decode_attention_quantized_reference(
        q, values, scales, tables, lens, scale
    )
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_native_quantized_decode_matches_reference_when_scores_span_hundreds(
    dtype: torch.dtype,
) -> None:
    """Most softmax weights fall below e^-87 here. The kernel's exp gives them 0, never the
    denormals that their products with the token scales once were; the output must not move."""
    torch.manual_seed(0)
    q, values, scales, tables, lens = random_quantized_batch([300, 64, 17], 9, 3, dtype)
    scales = scales * 100
    out = ops._NATIVE.paged_decode_attention_quantized(q, values, scales, tables, lens, 0.125)
    expected = ops.paged_decode_attention_quantized_reference(
        q, values, scales, tables, lens, 0.125
    )
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR * expected.abs().max()


@needs_native
@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("window", [None, 700])
def test_native_quantized_decode_merges_a_long_context_in_partitions(
    dtype: torch.dtype, window: int | None
) -> None:
    """Past 512 tokens a context runs in partitions whose sums merge (ops' float32 tests)."""
    torch.manual_seed(2)
    q, values, scales, tables, lens = random_quantized_batch([1500, 513, 40], 9, 3, dtype)
    out = ops._NATIVE.paged_decode_attention_quantized(
        q, values, scales, tables, lens, 0.2, window or 0
    )
    expected = ops.paged_decode_attention_quantized_reference(
        q, values, scales, tables, lens, 0.2, window
    )
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize("dtype", CODE_DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 500])
def test_native_quantized_decode_sliding_window_matches_reference(
    dtype: torch.dtype, window: int
) -> None:
    torch.manual_seed(window)
    q, values, scales, tables, lens = random_quantized_batch(
        [1, 15, 16, 17, 33, 100, 190], 4, 1, dtype
    )
    out = ops._NATIVE.paged_decode_attention_quantized(q, values, scales, tables, lens, 0.2, window)
    expected = ops.paged_decode_attention_quantized_reference(
        q, values, scales, tables, lens, 0.2, window
    )
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_native_quantized_decode_takes_int32_tables_and_odd_head_dim(dtype: torch.dtype) -> None:
    """head_dim 13: one 8-wide step and a scalar tail of 5."""
    torch.manual_seed(0)
    q, values, scales, tables, lens = random_quantized_batch(
        [5, 12, 3], 4, 2, dtype, head_dim=13, block_size=5
    )
    out = ops._NATIVE.paged_decode_attention_quantized(
        q, values, scales, tables.int(), lens.int(), 0.3
    )
    expected = ops.paged_decode_attention_quantized_reference(q, values, scales, tables, lens, 0.3)
    assert (out - expected).abs().max().item() < ATTENTION_MAX_ABS_ERROR


@needs_native
def test_native_quantized_decode_rejects_lengths_past_the_block_table() -> None:
    q, values, scales, tables, _ = random_quantized_batch([16], 2, 1, torch.int8)
    with pytest.raises(RuntimeError, match="outside"):
        ops._NATIVE.paged_decode_attention_quantized(
            q, values, scales, tables, torch.tensor([17]), 1.0
        )


@pytest.mark.parametrize("dtype", CODE_DTYPES)
def test_quantized_decode_stays_close_to_attention_over_the_exact_values(
    dtype: torch.dtype,
) -> None:
    """The whole cost of quantization on one attention over unit-normal K/V (outputs ~1 in
    size): measured up to 0.010 for int8 and 0.049 for fp8 over seeds 0-4; bounded at twice."""
    torch.manual_seed(3)
    kv_cache = torch.randn(2, 12, 16, 2, 64)
    q = torch.randn(3, 6, 64)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]])
    lens = torch.tensor([64, 40, 17])
    values, scales = ops.quantize_kv_reference(kv_cache, dtype)
    out = ops.paged_decode_attention_quantized(q, values, scales, tables, lens, 0.125)
    exact = ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.125)
    bound = 0.02 if dtype == torch.int8 else 0.1
    assert (out - exact).abs().max().item() < bound
