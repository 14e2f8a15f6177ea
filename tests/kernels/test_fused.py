"""The fused per-layer kernels (residual add + RMSNorm, rotary embedding, the SwiGLU and GeGLU
activations) against their torch references, including their in-place effects, and the torch
fallback."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from tokenmill.kernels import ops

# Both sides compute in float32 in different orders (and native's exp is a polynomial), so they
# differ by a few ulp; relative to the largest output that is far below this bound.
MAX_RELATIVE_ERROR = 1e-5

needs_native = pytest.mark.skipif(
    ops.backend() != "native", reason="native kernels did not load on this machine"
)
ROWS = [1, 3, 17, 300]  # 300 x 577 crosses the kernels' threshold for going multi-threaded


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def merged_qkv(tokens: int, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    return torch.randn(tokens, (heads + 2 * kv_heads) * head_dim)


def q_and_k_views(
    qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, d] and k [T, KVH, d] as the model gets them: strided column slices of qkv."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim)


def rope_tables(max_positions: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.outer(
        torch.arange(max_positions, dtype=torch.float64),
        10000.0 ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim),
    )
    return angles.cos().float(), angles.sin().float()


@needs_native
@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("dim", [576, 577, 5])
@pytest.mark.parametrize("with_residual", [False, True], ids=["first-norm", "add-then-norm"])
def test_native_add_rms_norm_matches_reference_and_updates_residual_in_place(
    tokens: int, dim: int, with_residual: bool
) -> None:
    torch.manual_seed(tokens * dim)
    x, weight = torch.randn(tokens, dim), torch.randn(dim)
    residual = torch.randn(tokens, dim) * 3 if with_residual else None
    expected_residual = None if residual is None else residual.clone()
    x_before = x.clone()
    expected, expected_sum = ops.add_rms_norm_reference(x.clone(), expected_residual, weight, 1e-6)

    normed = ops._NATIVE.add_rms_norm(x, residual, weight, 1e-6)
    assert relative_error(normed, expected) < MAX_RELATIVE_ERROR
    assert torch.equal(x, x_before)
    if residual is not None:
        assert relative_error(residual, expected_sum) < MAX_RELATIVE_ERROR


@pytest.mark.parametrize("with_residual", [False, True], ids=["first-norm", "add-then-norm"])
def test_add_rms_norm_returns_the_residual_tensor_it_updated(with_residual: bool) -> None:
    x, weight = torch.randn(2, 8), torch.randn(8)
    residual = torch.randn(2, 8) if with_residual else None
    expected_sum = x if residual is None else residual + x
    normed, new_residual = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert new_residual is (x if residual is None else residual)
    assert torch.allclose(new_residual, expected_sum)
    expected = F.rms_norm(expected_sum, (8,), weight, 1e-5)
    assert relative_error(normed, expected) < MAX_RELATIVE_ERROR


@needs_native
@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("head_dim", [64, 8])
def test_native_rotary_rotates_strided_qkv_views_in_place_like_reference(
    tokens: int, head_dim: int
) -> None:
    torch.manual_seed(tokens + head_dim)
    heads, kv_heads, max_positions = 9, 3, 2048
    cos, sin = rope_tables(max_positions, head_dim)
    positions = torch.randint(0, max_positions, (tokens,))
    qkv = merged_qkv(tokens, heads, kv_heads, head_dim)
    expected_qkv = qkv.clone()
    ops.rotary_embedding_reference(
        positions, *q_and_k_views(expected_qkv, heads, kv_heads, head_dim), cos, sin
    )

    ops._NATIVE.rotary_embedding(
        positions, *q_and_k_views(qkv, heads, kv_heads, head_dim), cos, sin
    )
    v_start = (heads + kv_heads) * head_dim
    assert relative_error(qkv[:, :v_start], expected_qkv[:, :v_start]) < MAX_RELATIVE_ERROR
    assert torch.equal(qkv[:, v_start:], expected_qkv[:, v_start:])  # v is never touched


def test_rotary_turns_each_pair_i_and_i_plus_half_by_its_positions_angle() -> None:
    angle = torch.tensor([[0.0, 0.0], [0.3, 1.1]])  # [positions, d/2]: pair 0 and pair 1
    cos, sin = angle.cos(), angle.sin()
    q = torch.tensor([[[1.0, 0.0, 0.0, 1.0]]])  # pair 0 = (1, 0), pair 1 = (0, 1)
    k = torch.tensor([[[2.0, 2.0, 0.0, 0.0]]])  # pair 0 = (2, 0), pair 1 = (2, 0)
    ops.rotary_embedding(torch.tensor([1]), q, k, cos, sin)
    c, s = cos[1], sin[1]
    assert torch.allclose(q[0, 0], torch.stack([c[0], -s[1], s[0], c[1]]))
    assert torch.allclose(k[0, 0], torch.stack([2 * c[0], 2 * c[1], 2 * s[0], 2 * s[1]]))


@needs_native
def test_native_rotary_rejects_positions_past_the_tables() -> None:
    cos, sin = rope_tables(16, 8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cos/sin tables"):
        ops._NATIVE.rotary_embedding(torch.tensor([3, 16]), q, k, cos, sin)


@needs_native
@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("width", [1536, 577, 3])
def test_native_silu_and_mul_matches_reference(tokens: int, width: int) -> None:
    torch.manual_seed(tokens * width)
    x = torch.randn(tokens, 2 * width) * 6  # gates reach both saturated ends of silu
    out = ops._NATIVE.silu_and_mul(x)
    assert out.shape == (tokens, width)
    assert relative_error(out, ops.silu_and_mul_reference(x)) < MAX_RELATIVE_ERROR


@needs_native
def test_native_silu_and_mul_saturates_like_torch_for_huge_gates() -> None:
    gates = torch.tensor([-1e4, -100.0, -88.5, -20.0, 0.0, 20.0, 88.5, 100.0, 1e4])
    x = torch.cat((gates, torch.full_like(gates, 2.0)))[None, :]
    out = ops._NATIVE.silu_and_mul(x)
    assert torch.allclose(out, ops.silu_and_mul_reference(x), rtol=1e-6, atol=1e-30)


def gelu_tanh_and_mul_float64(x: torch.Tensor) -> torch.Tensor:
    """tanh-GELU(gate) * up in float64 as gate * sigmoid(2u), which no cancellation touches."""
    gate, up = x.double().chunk(2, dim=-1)
    inner = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    return gate * torch.sigmoid(2 * inner) * up


@needs_native
@pytest.mark.parametrize("tokens", ROWS)
@pytest.mark.parametrize("width", [2048, 577, 3])
def test_native_gelu_tanh_and_mul_matches_float64_to_every_elements_digits(
    tokens: int, width: int
) -> None:
    """Each output within 2e-5 of its own size (the exponent's argument reaches ~90 and carries
    float32's rounding into exp), and where the true value is below float32's normal range,
    within 1e-34 of it; torch's reference, whose 1 + tanh(u) cancels, is close only relative to
    the largest output."""
    torch.manual_seed(tokens * width)
    x = torch.randn(tokens, 2 * width) * 6
    out = ops._NATIVE.gelu_tanh_and_mul(x)
    assert out.shape == (tokens, width)
    expected = gelu_tanh_and_mul_float64(x)
    error = (out.double() - expected).abs()
    assert bool((error <= 2e-5 * expected.abs() + 1e-34).all())
    assert relative_error(out, ops.gelu_tanh_and_mul_reference(x)) < MAX_RELATIVE_ERROR


@needs_native
def test_native_gelu_tanh_and_mul_saturates_for_huge_gates() -> None:
    gates = torch.tensor([-1e4, -100.0, -20.0, -5.0, 0.0, 5.0, 20.0, 100.0, 1e4])
    x = torch.cat((gates, torch.full_like(gates, 2.0)))[None, :]
    out = ops._NATIVE.gelu_tanh_and_mul(x)
    assert torch.allclose(out.double(), gelu_tanh_and_mul_float64(x), rtol=2e-5, atol=1e-30)


@needs_native
def test_non_float32_inputs_take_the_reference_path() -> None:
    x = torch.randn(3, 10, dtype=torch.float64)
    assert torch.equal(ops.silu_and_mul(x), ops.silu_and_mul_reference(x))
    assert torch.equal(ops.gelu_tanh_and_mul(x), ops.gelu_tanh_and_mul_reference(x))
    weight = torch.randn(10, dtype=torch.float64)
    assert torch.equal(
        ops.add_rms_norm(x, None, weight, 1e-6)[0], F.rms_norm(x, (10,), weight, 1e-6)
    )


def test_torch_backend_runs_the_references_with_the_same_in_place_effects(torch_ops) -> None:
    assert torch_ops.backend() == "torch"
    x, residual, weight = torch.randn(3, 12), torch.randn(3, 12), torch.randn(12)
    expected_sum = residual + x
    normed, new_residual = torch_ops.add_rms_norm(x, residual, weight, 1e-6)
    assert new_residual is residual and torch.equal(residual, expected_sum)
    assert torch.equal(normed, F.rms_norm(expected_sum, (12,), weight, 1e-6))

    cos, sin = rope_tables(32, 8)
    positions = torch.tensor([0, 5, 31])
    qkv = merged_qkv(3, 4, 2, 8)
    expected_qkv = qkv.clone()
    torch_ops.rotary_embedding_reference(positions, *q_and_k_views(expected_qkv, 4, 2, 8), cos, sin)
    torch_ops.rotary_embedding(positions, *q_and_k_views(qkv, 4, 2, 8), cos, sin)
    assert torch.equal(qkv, expected_qkv)

    gate_up = torch.randn(3, 20)
    assert torch.equal(torch_ops.silu_and_mul(gate_up), F.silu(gate_up[:, :10]) * gate_up[:, 10:])
    assert torch.equal(
        torch_ops.gelu_tanh_and_mul(gate_up),
        F.gelu(gate_up[:, :10], approximate="tanh") * gate_up[:, 10:],
    )
