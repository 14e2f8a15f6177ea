"""Products with a float32 or bfloat16 weight against F.linear, and which kernel takes how many
rows: the skinny kernel, the packed kernel, oneDNN's packed copy under torch's kernels."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import float_linear, ops

from .cases import needs_native, relative_error

# Bounds: both sides accumulate in float32 but in different orders, so they differ by rounding
# only; for these sizes that is ~1e-7 relative, well inside the bound below.
LINEAR_MAX_RELATIVE_ERROR = 1e-5  # max |native - F.linear| / max |F.linear|


@needs_native
@pytest.mark.parametrize("k", [1, 7, 8, 9, 64, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_linear_matches_f_linear_for_odd_shapes(k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(k)
    for m in range(1, ops.SKINNY_MAX_ROWS + 1):
        n = int(torch.randint(1, 70, (1,), generator=gen))
        x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
        bias = torch.randn(n, generator=gen) if with_bias else None
        out = ops._NATIVE.linear(x, weight, bias)
        assert relative_error(out, F.linear(x, weight, bias)) < LINEAR_MAX_RELATIVE_ERROR, (m, n)


@needs_native
def test_linear_keeps_leading_dims_and_uses_torch_for_wide_batches() -> None:
    weight, bias = torch.randn(33, 20), torch.randn(33)
    skinny = torch.randn(2, 3, 20)
    wide = torch.randn(ops.SKINNY_MAX_ROWS + 1, 20)
    assert ops.linear(skinny, weight, bias).shape == (2, 3, 33)
    assert relative_error(ops.linear(skinny, weight, bias), F.linear(skinny, weight, bias)) < 1e-5
    assert torch.equal(ops.linear(wide, weight, bias), F.linear(wide, weight, bias))


needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch was built without oneDNN"
)


@needs_onednn
@pytest.mark.parametrize("rows", [1, ops.SKINNY_MAX_ROWS + 1, 100, ops.PREPACKED_MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, x = torch.randn(70, 33, generator=gen), torch.randn(rows, 33, generator=gen)
    bias = torch.randn(70, generator=gen) if with_bias else None
    prepacked = ops.prepack_linear_weight(weight, 64)
    assert prepacked is not None
    out = ops.linear(x.view(1, rows, 33), weight, bias, prepacked)
    assert out.shape == (1, rows, 70)
    assert relative_error(out[0], F.linear(x, weight, bias)) < LINEAR_MAX_RELATIVE_ERROR


def assert_prepacked_serves_only_inference_batches_up_to_its_limit(
    linear_ops, calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`calls` collects the row counts the prepacked kernel saw. Its limit is PREPACKED_MAX_ROWS
    where MKL's GEMM is ahead past it (Intel CPUs), none elsewhere; both are set here (in
    `float_linear`, which owns the limit)."""
    weight = torch.randn(40, 24)
    prepacked = linear_ops.prepack_linear_weight(weight, 64)
    wide = torch.randn(linear_ops.PREPACKED_MAX_ROWS + 1, 24)
    monkeypatch.setattr(float_linear, "FLOAT32_PREPACKED_MAX_ROWS", linear_ops.PREPACKED_MAX_ROWS)
    assert torch.equal(linear_ops.linear(wide, weight, None, prepacked), F.linear(wide, weight))
    trained = torch.randn(40, 24, requires_grad=True)
    linear_ops.linear(trained, weight, None, prepacked).sum().backward()  # autograd: torch's GEMM
    assert trained.grad is not None
    linear_ops.linear(torch.randn(40, 24), weight, None, prepacked)
    assert calls == [40]
    monkeypatch.setattr(float_linear, "FLOAT32_PREPACKED_MAX_ROWS", sys.maxsize)
    out = linear_ops.linear(wide, weight, None, prepacked)
    assert calls == [40, wide.shape[0]]
    assert relative_error(out, F.linear(wide, weight)) < LINEAR_MAX_RELATIVE_ERROR
    assert linear_ops.prepack_linear_weight(weight.half(), 64) is None


@pytest.fixture
def onednn_rows(monkeypatch: pytest.MonkeyPatch, torch_ops):
    """`ops` under torch's kernels, and the row counts its oneDNN products see."""
    calls: list[int] = []
    onednn = torch.ops.mkldnn._linear_pointwise

    def counting(x, *args):
        calls.append(x.shape[0])
        return onednn(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counting)
    return torch_ops, calls


@needs_onednn
def test_onednn_prepacked_weight_serves_only_inference_batches_up_to_its_limit(
    onednn_rows, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_prepacked_serves_only_inference_batches_up_to_its_limit(*onednn_rows, monkeypatch)


@needs_onednn
def test_onednn_takes_exactly_the_rows_past_torch_plain_max_rows(onednn_rows) -> None:
    torch_ops, calls = onednn_rows
    weight = torch.randn(40, 24)
    prepacked = torch_ops.prepack_linear_weight(weight, 64)
    for rows in range(1, 6):
        x = torch.randn(rows, 24)
        out = torch_ops.linear(x, weight, None, prepacked)
        torch.testing.assert_close(out, F.linear(x, weight))
    assert calls == list(range(torch_ops.TORCH_PLAIN_MAX_ROWS + 1, 6))


@needs_native
def test_native_prepacked_weight_serves_only_inference_batches_up_to_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    native = ops._NATIVE

    class Counting:
        def __getattr__(self, name: str):
            return getattr(native, name)

        def packed_linear(self, x, *args):
            calls.append(x.shape[0])
            return native.packed_linear(x, *args)

    monkeypatch.setattr(ops, "_NATIVE", Counting())
    assert_prepacked_serves_only_inference_batches_up_to_its_limit(ops, calls, monkeypatch)


@needs_native
@pytest.mark.parametrize("k", [1, 7, 64, 577])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_packed_linear_matches_f_linear_for_odd_shapes(k: int, with_bias: bool) -> None:
    """Row counts of the narrow and the few-rows tiles, around the 6-row chunk, the 12-row zmm tile
    and the 96-row pass; N around the 16-output panel and the tiles' groups of panels."""
    gen = torch.Generator().manual_seed(k)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 33, 95, 96, 97, 200, ops.PREPACKED_MAX_ROWS):
        for n in (1, 15, 16, 17, 70, 129):
            x, weight = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
            bias = torch.randn(n, generator=gen) if with_bias else None
            out = ops._NATIVE.packed_linear(x, ops._NATIVE.pack_linear_weight(weight), n, bias)
            expected = F.linear(x, weight, bias)
            assert relative_error(out, expected) < LINEAR_MAX_RELATIVE_ERROR, (m, n)


@needs_native
def test_native_packed_linear_gives_a_row_the_same_bits_at_any_batch_size() -> None:
    """Every row count (narrow tiles, the 6-row tile, several passes) computes each output with
    the same FMAs in the same order, so a request decodes identically alone and in a batch."""
    gen = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(70, 200, generator=gen), torch.randn(70, generator=gen)
    x = torch.randn(130, 200, generator=gen)
    packed = ops._NATIVE.pack_linear_weight(weight)
    full = ops._NATIVE.packed_linear(x, packed, 70, bias)
    for start, m in ((0, 1), (5, 2), (9, 3), (20, 4), (31, 6), (50, 9), (40, 13), (3, 100)):
        rows = x[start : start + m].contiguous()
        assert torch.equal(
            ops._NATIVE.packed_linear(rows, packed, 70, bias), full[start : start + m]
        )


@needs_native
def test_native_packed_linear_rejects_a_weight_it_did_not_pack() -> None:
    weight, x = torch.randn(40, 24), torch.randn(40, 24)
    with pytest.raises(RuntimeError, match="pack_linear_weight"):
        ops._NATIVE.packed_linear(x, weight, 40, None)
    with pytest.raises(RuntimeError, match="n does not match"):
        ops._NATIVE.packed_linear(x, ops._NATIVE.pack_linear_weight(weight), 20, None)
    with pytest.raises(RuntimeError, match="disagree on K"):
        ops._NATIVE.packed_linear(
            torch.randn(40, 23), ops._NATIVE.pack_linear_weight(weight), 40, None
        )
