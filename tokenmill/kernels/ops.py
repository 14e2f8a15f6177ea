"""The one dispatch for compute kernels: native AVX2/OpenMP code when it loads, torch otherwise.

Every kernel has a pure-PyTorch reference (`*_reference`) that the tests compare against and that
runs whenever the native extension is switched off (`TOKENMILL_KERNELS=torch`), failed to load
(one warning line on stderr, never a crash), or does not cover the inputs (not float32, autograd,
a batch too wide for the skinny kernel, or a layout an in-place kernel cannot write through).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from tokenmill.kernels import build

BACKEND_ENV = "TOKENMILL_KERNELS"


def _intel_cpu() -> bool:
    """Whether Linux reports an Intel CPU (MKL's vendor check; False where unknown)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(
                line.split(":")[-1].strip() == "GenuineIntel"
                for line in cpuinfo
                if line.startswith("vendor_id")
            )
    except OSError:
        return False


# Above this many rows of x, MKL's blocked GEMM beats a kernel that streams the weights once.
# Measured over SmolLM2 layers' four products with weights from DRAM (ms per layer, native vs
# torch): 24 rows 2.3 vs 2.7, 32 rows 2.8 vs 3.2, 48 rows 4.0 vs 4.0, 64 rows 5.2 vs 4.8.
SKINNY_MAX_ROWS = 32
# Up to this many rows of x, a GEMM on a copy of the weight packed for it (`prepack_linear_weight`)
# beats MKL's on the plain weight; above, MKL is ahead. The copy is the native blocked kernel's
# panels, or oneDNN's blocked format under torch's kernels. Over SmolLM2's layer products,
# GFLOP/s oneDNN-prepacked vs plain: 33 rows 86 vs 58, 64 rows 105 vs 67, 256 rows 128 vs 111,
# 512 rows 119 vs 125, 2048 rows 132 vs 147; at 1 row (no native kernels) 16.5 vs 12.0 GB/s. The
# native kernel measured 1.1-1.5x oneDNN's at 24-256 rows (csrc/packed_linear.cpp). For a
# bfloat16 weight on AMX (csrc/bfloat16_linear.cpp) the same bound holds: SmolLM2's layer products,
# TFLOP/s AMX vs torch's bfloat16 GEMM, 64 rows 0.87 vs 0.56, 256 rows 1.50 vs 1.21, 512 rows
# 1.70 vs 1.76, 2048 rows 1.25 vs 2.56.
PREPACKED_MAX_ROWS = 256
# MKL takes its fast paths on Intel CPUs only. Elsewhere a float32 product of any number of rows
# runs faster on the packed copy than on MKL's plain-weight GEMM, so there every float32 product
# with a packed copy takes it: on a 2-core AMD EPYC (Zen 4), SmolLM2's layer products at 512 and
# 2,048 rows, GFLOP/s, native 201-214, oneDNN's 209-223, MKL's 177-203.
INTEL_CPU = _intel_cpu()
FLOAT32_PREPACKED_MAX_ROWS = PREPACKED_MAX_ROWS if INTEL_CPU else sys.maxsize
# Under torch's kernels, up to this many rows MKL's product on the plain weight streams faster
# than oneDNN's GEMM on the packed copy where the CPU is an Intel one with AVX-512. All 121 of
# SmolLM2's products, GB/s plain vs packed, on a 2-core AVX-512 Xeon: 1 row 26.3 vs 20.0, 2 rows
# 24.5 vs 19.0, 3 rows 19.9-22.3 vs 18.8-19.1, 4 rows 14.5 vs 19.1; on the AVX2 machine before it,
# packed won at one row (16.5 vs 12.0). MKL takes its fast paths on Intel CPUs only: on a 2-core
# AMD EPYC (Zen 4) its one-row products ran at 11 GB/s whatever the threads (the 49,152-row LM
# head 9.8 ms) against oneDNN's 26 (4.3 ms).
TORCH_PLAIN_MAX_ROWS = 3 if torch.backends.cpu.get_cpu_capability() == "AVX512" and INTEL_CPU else 0
# Up to this many rows of x, the skinny kernel on a bfloat16 weight (widened to float32 as it is
# read) beats torch's bfloat16 product, which streamed SmolLM2's weights at about 12 GB/s at any
# batch from 1 to 32 rows (oneDNN, with AMX, on a 2-core AVX-512 Xeon). All 121 products, ms,
# native vs torch: 1 row 13.2 vs 22.1, 2 rows 13.5 vs 23.0, 4 rows 16.7 vs 22.7, 6 rows 22.7 vs
# 22.9, 8 rows 26.7 vs 22.8.
BFLOAT16_SKINNY_MAX_ROWS = 4


def _warn(message: str) -> None:
    print(f"tokenmill: {message}", file=sys.stderr)


def _load_native() -> ModuleType | None:
    """The extension module, or None when the torch reference should run."""
    choice = os.environ.get(BACKEND_ENV, "native").strip().lower()
    if choice == "torch":
        return None
    if choice != "native":
        _warn(f"{BACKEND_ENV}={choice!r} is neither 'native' nor 'torch'; trying native")
    # The kernels are compiled for AVX2 + FMA; on an older CPU they would die on SIGILL.
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _warn("native kernels need AVX2; using the torch reference kernels")
        return None
    try:
        return build.load_extension()
    except Exception as exc:  # any build or load failure must leave a working engine
        first_line = str(exc).strip().partition("\n")[0][:160]
        reason = f"{type(exc).__name__}: {first_line}"
        _warn(
            f"native kernels unavailable ({reason}); using the torch reference kernels "
            "(details: python scripts/build_kernels.py)"
        )
        return None


_NATIVE = _load_native()


def amx_available() -> bool:
    """Whether AMX tiles run here: the native kernels loaded, and the CPU has AMX and Linux let
    this process use it (asked once)."""
    return _NATIVE is not None and _NATIVE.amx_available()


def bfloat16_linear_available() -> bool:
    """Whether bfloat16 products run natively on a packed weight: on AMX tiles, or with
    AVX512-BF16 dot products where the CPU has those but no AMX (AMD Zen 4, Intel Cooper Lake)."""
    return _NATIVE is not None and _NATIVE.bfloat16_linear_available()


def backend() -> str:
    """Which kernels run: "native" (the extension) or "torch" (every op's reference)."""
    return "torch" if _NATIVE is None else "native"


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prepacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear` (x: [..., K], weight: [N, K], bias: [N]). With the native kernels: the packed
    kernel on `prepacked` (from `prepack_linear_weight`) up to FLOAT32_PREPACKED_MAX_ROWS rows of
    x, else the skinny kernel on the plain weight up to SKINNY_MAX_ROWS. With torch's: oneDNN on
    `prepacked` from past TORCH_PLAIN_MAX_ROWS up to FLOAT32_PREPACKED_MAX_ROWS. A bfloat16
    weight: AMX or AVX512-BF16 on `prepacked` up to PREPACKED_MAX_ROWS, else (neither) the
    skinny kernel up to BFLOAT16_SKINNY_MAX_ROWS, their outputs rounded to bfloat16 as torch's
    are. Everything else: torch's GEMM on the plain weight."""
    rows = x.numel() // max(x.shape[-1], 1) if x.dim() >= 1 else 0
    inference = not (x.requires_grad and torch.is_grad_enabled())
    max_rows = PREPACKED_MAX_ROWS if x.dtype == torch.bfloat16 else FLOAT32_PREPACKED_MAX_ROWS
    packed_fits = prepacked is not None and inference and rows <= max_rows
    if _NATIVE is None:
        if packed_fits and rows > TORCH_PLAIN_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, prepacked, bias, "none", [], "")
        return linear_reference(x, weight, bias)
    if packed_fits and rows >= 1 and _native_friendly((x,)):
        n = weight.shape[0]
        return _flat_rows(_NATIVE.packed_linear, x, n, prepacked, n, bias)
    if packed_fits and rows >= 1 and _native_friendly((x,), torch.bfloat16):
        n = weight.shape[0]
        return _flat_rows(_NATIVE.bfloat16_linear, x, n, prepacked, n, bias)
    if _skinny_linear_fits(x, weight, bias):
        return _flat_rows(_NATIVE.linear, x, weight.shape[0], weight, bias)
    if _skinny_linear_fits(x, weight, bias, BFLOAT16_SKINNY_MAX_ROWS, torch.bfloat16):
        wide_bias = None if bias is None else bias.float()
        out = _flat_rows(_NATIVE.linear, x.float(), weight.shape[0], weight, wide_bias)
        return out.to(torch.bfloat16)
    return linear_reference(x, weight, bias)


def _flat_rows(
    kernel: Callable[..., torch.Tensor], x: torch.Tensor, n: int, *args: Any
) -> torch.Tensor:
    """`kernel(x2d, *args)` on x's rows flattened to [M, K], shaped back to [..., n]."""
    if x.dim() == 2:  # the usual flat batch; reshaping costs more than the kernel call
        return kernel(x, *args)
    return kernel(x.reshape(-1, x.shape[-1]), *args).view(*x.shape[:-1], n)


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _skinny_linear_fits(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    max_rows: int = SKINNY_MAX_ROWS,
    dtype: torch.dtype = torch.float32,
) -> bool:
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return (
        x.dim() >= 1
        and x.shape[-1] > 0
        and x.numel() <= max_rows * x.shape[-1]
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
        and _native_friendly(tensors, dtype)
    )


def prepack_linear_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """A copy of a float32 weight [N, K] laid out for batched products: the native blocked
    kernel's panels, or under torch's kernels oneDNN's blocked format for about `batch_hint` rows
    of x. None where neither applies (torch without oneDNN, a weight not float32 on the CPU). The
    copy is extra memory: the plain weight stays for the other paths. A bfloat16 weight, where
    the native kernels load and the CPU has AMX or AVX512-BF16: the tiles `bfloat16_linear`
    reads."""
    if weight.dtype == torch.bfloat16 and weight.is_cpu and bfloat16_linear_available():
        with torch.no_grad():
            return _NATIVE.pack_bfloat16_weight(weight.detach())
    if not (weight.dtype == torch.float32 and weight.is_cpu):
        return None
    with torch.no_grad():
        if _NATIVE is not None:
            return _NATIVE.pack_linear_weight(weight.detach())
        if not torch.backends.mkldnn.is_available():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a prompt's new positions: q [n, H, d] holds the last n of the S
    positions whose keys and values are k and v [S, kv_heads, d]; GQA by head groups. With a
    sliding `window`, each position also sees only itself and the `window - 1` before it.

    A bfloat16 model's runs on AMX tiles (csrc/prefill_attention.cpp) where the CPU has them and
    each position's heads are contiguous with a head_dim a multiple of 32 up to 256; anything
    else runs torch's SDPA."""
    if _prefill_attention_fits(q, k, v):
        return _NATIVE.prefill_attention(q, k, v, scale, window or 0)
    return prefill_attention_reference(q, k, v, scale, window)


def _prefill_attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if not (amx_available() and _native_friendly((q, k, v), torch.bfloat16)):
        return False
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        return False
    head_dim = q.shape[2]
    return (
        head_dim % 32 == 0
        and head_dim <= 256
        and k.shape[2] == head_dim
        and q.shape[1] % k.shape[1] == 0
        and 1 <= q.shape[0] <= k.shape[0]
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
    )


def prefill_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """torch's SDPA: its causal kernel when the query is the whole context and no window hides
    keys, else an explicit mask."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    windowed = window is not None and window < kv_len
    if q_len == kv_len and not windowed:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        offset = kv_len - q_len
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=offset)
        if windowed:
            allowed = allowed.triu(diagonal=offset - window + 1)
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=allowed, scale=scale, enable_gqa=True
        )
    return out.squeeze(0).transpose(0, 1)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence, attending over its first `seq_lens[b]` cached positions,
    or with a sliding `window` over only the last `window` of them (Gemma 3's local layers).

    q: [B, H, d]; kv_cache: [2, num_blocks, block_size, kv_heads, d] (K then V);
    block_tables: [B, max_blocks] int32/int64; seq_lens: [B] ints in [1, max_blocks * block_size].
    Returns [B, H, d]. Native reads K and V in place through the block tables (no gather copy);
    a bfloat16 model's q and cache too, computing in float32 and rounding the output once.
    """
    if _NATIVE is None or not (kv_cache.is_contiguous() and _float32_or_bfloat16((q, kv_cache))):
        return paged_decode_attention_reference(q, kv_cache, block_tables, seq_lens, scale, window)
    return _NATIVE.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, window or 0)


def paged_decode_attention_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks, then one batched SDPA. The query heads sharing a KV head
    are passed as that head's "query positions", so grouped-query attention never repeats K/V."""
    keys, values = (gather_blocks(cache, block_tables) for cache in kv_cache)
    return _decode_sdpa(q, keys, values, seq_lens, scale, window)


def _decode_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """The references' attention once K and V are gathered, `[B * max_blocks * block_size,
    kv_heads, d]` each: every sequence's first seq_lens[b] rows (its last `window` of them)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[-2]
    keys, values = (
        t.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2) for t in (keys, values)
    )  # [B, kv_heads, max_blocks * block_size, d]
    position = torch.arange(keys.shape[2])
    lens = seq_lens.reshape(-1, 1).cpu()
    inside = position < lens  # [B, L], True = attend
    if window:
        inside &= position >= lens - window
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(
        grouped,
        keys.to(q.dtype),
        values.to(q.dtype),
        attn_mask=inside[:, None, None, :],
        scale=scale,
    )
    return out.reshape(batch, num_heads, head_dim)


def store_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Writes k and v [T, kv_heads, d] into the cache [2, num_blocks, block_size, kv_heads, d]
    at their flat slots (`slot = block * block_size + offset`, int64 [T]). k and v may be
    strided views (column slices of the merged qkv output) whose heads are contiguous. The
    cache, k and v are float32, or (a bfloat16 model's) bfloat16."""
    if _NATIVE is None or not (
        slot_mapping.dtype == torch.int64
        and kv_cache.is_contiguous()
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and _float32_or_bfloat16((kv_cache, k, v))
    ):
        store_kv_reference(kv_cache, slot_mapping, k, v)
        return
    _NATIVE.store_kv(kv_cache, slot_mapping, k, v)


def store_kv_reference(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    flat = kv_cache.view(2, -1, *kv_cache.shape[-2:])
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Rows of one cache half ([num_blocks, block_size, kv_heads, d]) for the given blocks, as
    `[block_ids.numel() * block_size, kv_heads, d]`; index_select on the flattened blocks is
    several times faster than advanced indexing here."""
    flat = cache.view(cache.shape[0], -1).index_select(0, block_ids.reshape(-1).long())
    return flat.view(-1, *cache.shape[-2:])


# The quantized KV cache (tokenmill/kv/quantized.py): codes int8 or float8_e4m3fn
# [2, num_blocks, block_size, kv_heads, d] and fp32 scales [2, num_blocks, block_size, kv_heads],
# one per token and KV head: codes = x * (qmax / max|x|), rounded (int8: to nearest even, fp8:
# e4m3's own rounding), scale = max|x| / qmax; a head of zeros gets scale 0 and zero codes.
KV_CODE_MAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (codes [..., d] of `dtype`, fp32 scales [...])."""
    x = x.float()
    max_abs = x.abs().amax(dim=-1)
    # Tensor / tensor, as the native kernel divides: `448.0 / t` would round twice.
    limit = torch.full_like(max_abs, KV_CODE_MAX[dtype])
    inverse = torch.where(max_abs > 0, limit / max_abs, torch.zeros_like(max_abs))
    scaled = (x * inverse[..., None]).clamp(-limit[..., None], limit[..., None])
    codes = torch.round(scaled) if dtype == torch.int8 else scaled
    return codes.to(dtype), max_abs / limit


def dequantize_kv_reference(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 codes * scales[..., None]; codes [..., d], scales [...]."""
    return codes.float() * scales[..., None]


def store_kv_quantized(
    values: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`store_kv` into a quantized cache: each token's k and v heads [T, kv_heads, d] (float32,
    or a bfloat16 model's) are quantized on their own and written with their scales at their
    flat slots."""
    if _NATIVE is None or not (
        slot_mapping.dtype == torch.int64
        and values.is_contiguous()
        and scales.is_contiguous()
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and _native_friendly((scales,))
        and _float32_or_bfloat16((k, v))
    ):
        store_kv_quantized_reference(values, scales, slot_mapping, k, v)
        return
    _NATIVE.store_kv_quantized(values, scales, slot_mapping, k, v)


def store_kv_quantized_reference(
    values: torch.Tensor,
    scales: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    # As bytes: index_copy_ has no fp8 kernel.
    flat_values = values.view(torch.uint8).view(2, -1, *values.shape[-2:])
    flat_scales = scales.view(2, -1, scales.shape[-1])
    for half, x in enumerate((k, v)):
        codes, x_scales = quantize_kv_reference(x, values.dtype)
        flat_values[half].index_copy_(0, slot_mapping, codes.view(torch.uint8))
        flat_scales[half].index_copy_(0, slot_mapping, x_scales)


def gather_blocks_dequantized(
    codes: torch.Tensor, scales: torch.Tensor, block_ids: torch.Tensor
) -> torch.Tensor:
    """`gather_blocks` of one quantized cache half (codes [num_blocks, block_size, kv_heads, d],
    scales [num_blocks, block_size, kv_heads]), as fp32 `[n * block_size, kv_heads, d]`."""
    gathered = gather_blocks(codes.view(torch.uint8), block_ids).view(codes.dtype)
    ids = block_ids.reshape(-1).long()
    row_scales = scales.view(scales.shape[0], -1).index_select(0, ids).view(-1, scales.shape[-1])
    return dequantize_kv_reference(gathered, row_scales)


def paged_decode_attention_quantized(
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """`paged_decode_attention` over a quantized cache. Native reads the 8-bit codes in place
    and dequantizes them inside the online softmax (code * the token's scale), so a decode
    streams a quarter of fp32's KV bytes. A bfloat16 q (a bfloat16 model's) gives the float32
    q's result rounded once, on both paths."""
    if _NATIVE is None or not (
        values.is_contiguous()
        and scales.is_contiguous()
        and _native_friendly((scales,))
        and _float32_or_bfloat16((q,))
    ):
        return paged_decode_attention_quantized_reference(
            q, values, scales, block_tables, seq_lens, scale, window
        )
    return _NATIVE.paged_decode_attention_quantized(
        q, values, scales, block_tables, seq_lens, scale, window or 0
    )


def paged_decode_attention_quantized_reference(
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    keys, vals = (gather_blocks_dequantized(values[i], scales[i], block_tables) for i in (0, 1))
    return _decode_sdpa(q.float(), keys, vals, seq_lens, scale, window).to(q.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of `residual + x` (of `x` alone when residual is None) fused with that add.

    x, residual: [..., D]; weight: [D]. Returns (normed, new_residual); normed is a new tensor.
    On both backends the sum is written into `residual` in place and new_residual *is* that
    tensor (or `x` itself when residual is None), so the caller just rebinds its residual. All
    float32, or all bfloat16 (computed in float32, rounded where torch's reference rounds).
    """
    tensors = (x, weight) if residual is None else (x, residual, weight)
    if _NATIVE is None or not (
        (residual is None or residual.is_contiguous()) and _float32_or_bfloat16(tensors)
    ):
        return add_rms_norm_reference(x, residual, weight, eps)
    return _NATIVE.add_rms_norm(x, residual, weight, eps), x if residual is None else residual


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is None:
        residual = x
    else:
        residual.add_(x)
    return F.rms_norm(residual, (x.shape[-1],), weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Rotates q [T, H, d] and k [T, KVH, d] in place by their tokens' positions (int64 [T]),
    GPT-NeoX layout: each pair (i, i + d/2) by the angle whose cos/sin are row `positions[t]`,
    column i of cos/sin [max_positions, d/2].

    q and k may be strided views (e.g. column slices of the merged qkv output): native writes
    through any token and head stride as long as each head's d values are contiguous. q and k
    may be bfloat16 (cos and sin float32): rotated in float32, rounded once, as here.
    """
    if _NATIVE is None or not (
        positions.dtype == torch.int64
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and _native_friendly((cos, sin))
        and _float32_or_bfloat16((q, k))
    ):
        rotary_embedding_reference(positions, q, k, cos, sin)
        return
    _NATIVE.rotary_embedding(positions, q, k, cos, sin)


def rotary_embedding_reference(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    cos_rows, sin_rows = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, d/2]
    for x in (q, k):
        first, second = x.chunk(2, dim=-1)
        x.copy_(
            torch.cat(
                (first * cos_rows - second * sin_rows, second * cos_rows + first * sin_rows),
                dim=-1,
            )
        )


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: x [..., 2F] holds gate then up; returns silu(gate) * up, [..., F].
    float32 or bfloat16 (silu(gate) rounded before the product, as the reference rounds it)."""
    if _NATIVE is None or not _float32_or_bfloat16((x,)):
        return silu_and_mul_reference(x)
    return _NATIVE.silu_and_mul(x)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation (Gemma): x [..., 2F] holds gate then up; returns
    gelu(gate, approximate="tanh") * up, [..., F], float32 or bfloat16 (rounded before the
    product, as the reference rounds it). Native computes gelu_tanh(g) as g * sigmoid(2u): the
    reference's 1 + tanh(u) cancels for gates below about -4, where native keeps the digits."""
    if _NATIVE is None or not _float32_or_bfloat16((x,)):
        return gelu_tanh_and_mul_reference(x)
    return _NATIVE.gelu_tanh_and_mul(x)


def gelu_tanh_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, [rows] int64, for x [rows, n] float32 or bfloat16:
    the first on ties, and a row's first NaN if it holds one, as torch.max gives. Greedy sampling
    takes it straight from the LM head's output: widening bfloat16 is exact, so a bfloat16 row
    needs no float32 copy to give the same token."""
    if _NATIVE is None or x.dim() != 2 or x.shape[-1] == 0 or not _float32_or_bfloat16((x,)):
        return row_argmax_reference(x)
    return _NATIVE.row_argmax(x)


def row_argmax_reference(x: torch.Tensor) -> torch.Tensor:
    # max's indices are argmax's, the first maximum on ties included, in under half the time
    # over a wide row (0.8 against 2.0 ms for 64 rows of 49,152 here).
    return x.max(dim=-1).indices


# Quantized weights (tokenmill/quant builds them). Along K a row is cut into blocks of 32 inputs
# (zero-padded), and each row has one scale per group of `group_size` inputs, group_size a
# multiple of 32 (the last group may be short):
#   int8: qweight int8 [N, ceil(K / 32) * 32], w = scale * q; one group per row is per-channel.
#   int4: qweight uint8 [N, ceil(K / 64) * 32], w = scale * q + min, q in 0..15; each 64 inputs
#         take 32 bytes, input i in the low nibble of byte i, input 32 + i in its high nibble.
# scales (and mins) are [N, ceil(K / group_size)], float16 or float32.
#
# That row-major form is what checkpoints hold. The native kernels read a copy regrouped into
# panels of 8 rows (`pack_int8_panels`, `pack_int4_panels`; the quantized layers keep it).
#
# For up to QUANT_KERNEL_MAX_ROWS rows, native rounds x per block of 32 to integers (int8,
# scale max|x| / 127, for int4 weights, as llama.cpp does; int16, max|x| / 32767, for int8
# weights) and multiplies in integers; the references round x the same way before an fp32
# product with the dequantized weight, so both backends compute one function
# (tests/kernels/test_quant_linear.py bounds the difference, and the rounding's own error).
# Wider x is multiplied in fp32 by the dequantized weight on both.

# Above this many rows of x, expanding the weight to fp32 once and running torch's GEMM beats
# the integer kernel. Measured per SmolLM2 layer (ms, panel kernel vs expand + GEMM): int4 at
# 64 rows 4.0-4.4 vs 5.7-8.7, at 128 7.9 vs 9.2, at 256 17.4 vs 16.3; int8 at 64 rows 6.0 vs
# 7.0, at 128 12.6 vs 9.6 (docs/quantization.md).
QUANT_KERNEL_MAX_ROWS = 64
QUANT_BLOCK = 32
# Weights expanded to fp32 at a time for a wide product: 8 MB, cache-resident until used.
DEQUANTIZE_TILE_WEIGHTS = 1 << 21
INT8_WEIGHT_ACTIVATION_BITS = 16
INT4_WEIGHT_ACTIVATION_BITS = 8


PANEL_ROWS = 8


class QuantPanels(NamedTuple):
    """A quantized weight regrouped for the native kernels (csrc/quant_linear.cpp): panels of
    PANEL_ROWS output rows whose codes interleave so that each SIMD lane holds one row."""

    values: torch.Tensor  # uint8 [panels, blocks * bytes per block]
    scales: torch.Tensor  # [panels, groups, PANEL_ROWS]
    mins: torch.Tensor | None  # int4's, like scales
    out_features: int


def _panel_rows(t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] zero-padded to whole panels, as [panels, PANEL_ROWS, ...]."""
    padded = F.pad(t, (0, 0) * (t.dim() - 1) + (0, -t.shape[0] % PANEL_ROWS))
    return padded.view(-1, PANEL_ROWS, *t.shape[1:])


def _panel_groups(per_group: torch.Tensor) -> torch.Tensor:
    """[N, groups] -> [panels, groups, PANEL_ROWS]."""
    return _panel_rows(per_group).transpose(1, 2).contiguous()


def pack_int4_panels(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, in_features: int
) -> QuantPanels:
    """The int4 weight (qweight, scales, mins) in panels: per panel and block of 32 inputs, four
    32-byte vectors; vector v gives row r the 4 bytes of lane r, byte j holding input 8v + j in
    its low nibble and 8v + 4 + j in its high one."""
    blocks = -(-in_features // QUANT_BLOCK)
    codes = unpack_int4(qweight, qweight.shape[1] * 2)[:, : blocks * QUANT_BLOCK]
    # [panels, row, block, v, half, j] -> [panels, block, v, row, j, half]
    split = _panel_rows(codes).view(-1, PANEL_ROWS, blocks, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    values = (split[..., 0] | (split[..., 1] << 4)).contiguous().view(split.shape[0], -1)
    return QuantPanels(values, _panel_groups(scales), _panel_groups(mins), qweight.shape[0])


def pack_int8_panels(qweight: torch.Tensor, scales: torch.Tensor) -> QuantPanels:
    """The int8 weight (qweight, scales) in panels: per panel and block of 32 inputs, sixteen
    16-byte units; unit u gives row r bytes 2r and 2r + 1, inputs 2u and 2u + 1."""
    codes = _panel_rows(qweight.view(torch.uint8))
    # [panels, row, block, u, j] -> [panels, block, u, row, j]
    split = codes.view(codes.shape[0], PANEL_ROWS, -1, 16, 2).permute(0, 2, 3, 1, 4)
    values = split.contiguous().view(codes.shape[0], -1)
    return QuantPanels(values, _panel_groups(scales), None, qweight.shape[0])


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the int8 weight w = (qweight, scales); x: [..., K]. `panels`
    is w from `pack_int8_panels`, which the native kernel reads (packed here when not given)."""
    if _NATIVE is None or not _quantized_fits(x, bias):
        return int8_linear_reference(x, qweight, scales, group_size, bias)
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.shape[0] > QUANT_KERNEL_MAX_ROWS:
        rows = lambda part: _NATIVE.dequantize_int8(  # noqa: E731
            qweight[part], scales[part], group_size, x.shape[-1]
        )
        return _tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    if panels is None:
        panels = pack_int8_panels(qweight, scales)
    out = _NATIVE.int8_linear(
        flat, panels.values, panels.scales, panels.out_features, group_size, bias
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def int8_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    weight = dequantize_int8_reference(qweight, scales, group_size, x.shape[-1])
    x = kernel_activations(x, INT8_WEIGHT_ACTIVATION_BITS)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def int4_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    panels: QuantPanels | None = None,
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the int4 weight w = (qweight, scales, mins); x: [..., K].
    `panels` is w from `pack_int4_panels`, which the native kernel reads (packed here when not
    given)."""
    if _NATIVE is None or not _quantized_fits(x, bias):
        return int4_linear_reference(x, qweight, scales, mins, group_size, bias)
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if flat.shape[0] > QUANT_KERNEL_MAX_ROWS:
        rows = lambda part: _NATIVE.dequantize_int4(  # noqa: E731
            qweight[part], scales[part], mins[part], group_size, x.shape[-1]
        )
        return _tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    if panels is None:
        panels = pack_int4_panels(qweight, scales, mins, x.shape[-1])
    out = _NATIVE.int4_linear(
        flat, panels.values, panels.scales, panels.mins, panels.out_features, group_size, bias
    )
    return out if x.dim() == 2 else out.view(*x.shape[:-1], qweight.shape[0])


def int4_linear_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    weight = dequantize_int4_reference(qweight, scales, mins, group_size, x.shape[-1])
    x = kernel_activations(x, INT4_WEIGHT_ACTIVATION_BITS)
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def _tiled_dequantized_linear(
    flat: torch.Tensor,
    shape: torch.Size,
    out_features: int,
    dequantize_rows: Callable[[slice], torch.Tensor],
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """torch's GEMM on the weight expanded to fp32 a tile of output rows at a time
    (`dequantize_rows(rows)`): each tile (a few MB) is still in cache when the GEMM reads it, so
    DRAM sees only the packed bytes."""
    tile = max(1, DEQUANTIZE_TILE_WEIGHTS // flat.shape[1])
    if out_features <= tile:
        weight = dequantize_rows(slice(None))
        return F.linear(flat, weight, bias).view(*shape[:-1], out_features)
    out = torch.empty(flat.shape[0], out_features, dtype=flat.dtype)
    for start in range(0, out_features, tile):
        part = slice(start, start + tile)
        out[:, part] = F.linear(flat, dequantize_rows(part), None if bias is None else bias[part])
    return out.view(*shape[:-1], out_features)


def dequantize_int8(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int, in_features: int
) -> torch.Tensor:
    """The fp32 weight [N, in_features] an int8 (qweight, scales) pair stands for."""
    if _NATIVE is None:
        return dequantize_int8_reference(qweight, scales, group_size, in_features)
    return _NATIVE.dequantize_int8(qweight, scales, group_size, in_features)


def dequantize_int8_reference(
    qweight: torch.Tensor, scales: torch.Tensor, group_size: int, in_features: int
) -> torch.Tensor:
    values = qweight[:, :in_features].float()
    return values * _per_input(scales, group_size, in_features)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """The fp32 weight [N, in_features] an int4 (qweight, scales, mins) triple stands for."""
    if _NATIVE is None:
        return dequantize_int4_reference(qweight, scales, mins, group_size, in_features)
    return _NATIVE.dequantize_int4(qweight, scales, mins, group_size, in_features)


def dequantize_int4_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    values = unpack_int4(qweight, in_features).float()
    return values * _per_input(scales, group_size, in_features) + _per_input(
        mins, group_size, in_features
    )


def unpack_int4(qweight: torch.Tensor, in_features: int) -> torch.Tensor:
    """uint8 values 0..15 [N, in_features] from the packed int4 layout."""
    units = qweight.view(qweight.shape[0], -1, 1, QUANT_BLOCK)
    nibbles = torch.cat((units & 0x0F, units >> 4), dim=2)  # [N, units, 2, 32]
    return nibbles.view(qweight.shape[0], -1)[:, :in_features]


def _per_input(group_values: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """[N, groups] -> [N, in_features] fp32: each group's value repeated over its inputs."""
    return group_values.float().repeat_interleave(group_size, dim=1)[:, :in_features]


def kernel_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x as the quantized products see it: rounded through `bits`-bit blocks of 32 when it has
    at most QUANT_KERNEL_MAX_ROWS rows, unchanged when wider."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > QUANT_KERNEL_MAX_ROWS:
        return x
    values, scales, _ = quantize_activations_reference(flat, bits)
    blocks = values.view(flat.shape[0], -1, QUANT_BLOCK).float() * scales[..., None]
    return blocks.view(flat.shape[0], -1)[:, : x.shape[-1]].view(x.shape).to(x.dtype)


def quantize_activations_reference(
    x: torch.Tensor, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the native quantized kernels make of fp32 x [M, K] before multiplying: int8 or
    int16 values [M, blocks * 32] (zero-padded), per-block scales max|x| / (2**(bits-1) - 1)
    [M, blocks] and scale * sum(values)."""
    rows, k = x.shape
    blocks = -(-k // QUANT_BLOCK)
    padded = F.pad(x.float(), (0, blocks * QUANT_BLOCK - k)).view(rows, blocks, QUANT_BLOCK)
    max_abs = padded.abs().amax(dim=-1)
    # Tensor / tensor: `127.0 / t` would be computed as 127 * (1 / t), rounding twice.
    limit = torch.full_like(max_abs, 2 ** (bits - 1) - 1)
    inverse = torch.where(max_abs > 0, limit / max_abs, torch.zeros_like(max_abs))
    dtype = torch.int8 if bits == 8 else torch.int16
    values = torch.round(padded * inverse[..., None]).to(dtype)
    scales = max_abs / limit
    sums = scales * values.sum(dim=-1, dtype=torch.int32).float()
    return values.view(rows, -1), scales, sums


# fp8 weights (tokenmill/quant/fp8.py): qweight float8_e4m3fn [N, K], w = scale * q with one
# float32 scale per row [N]. Up to SKINNY_MAX_ROWS rows of x, native decodes the codes to fp32
# in registers as it loads them and multiplies in fp32; wider x multiplies by the weight
# dequantized tile by tile, and the reference by the whole dequantized weight.

# fp16 holds e4m3's bits with 8 more exponent bias: decoded values are the e4m3 values * 2^-8.
FP8_DECODE_SCALE = 256.0


def fp8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, w, bias)` for the fp8 weight w = (qweight, scales); x: [..., K]."""
    if _NATIVE is None or not _quantized_fits(x, bias):
        return fp8_linear_reference(x, qweight, scales, bias)
    if x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS:  # decode: skip the reshapes
        return _NATIVE.fp8_linear(x, qweight, scales, bias)
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] > SKINNY_MAX_ROWS:
        rows = lambda part: _NATIVE.dequantize_fp8(qweight[part], scales[part])  # noqa: E731
        return _tiled_dequantized_linear(flat, x.shape, qweight.shape[0], rows, bias)
    out = _NATIVE.fp8_linear(flat, qweight, scales, bias)
    return out.view(*x.shape[:-1], qweight.shape[0])


def fp8_linear_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    weight = dequantize_fp8_reference(qweight, scales).to(x.dtype)
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] an fp8 (qweight, scales) pair stands for."""
    if _NATIVE is None:
        return dequantize_fp8_reference(qweight, scales)
    return _NATIVE.dequantize_fp8(qweight, scales)


def dequantize_fp8_reference(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's own fp8 -> fp32 cast runs at ~0.1 G values/s here, so this moves bits instead:
    e4m3 bits s eeee mmm, sign-extended to 16 bits and shifted left by 7, are fp16's
    s eeeee mmmmmmmmmm with a stray copy of s in the top exponent bit; clearing it leaves an
    fp16 equal to the e4m3 value times 2^-8, subnormals included (NaN codes never occur)."""
    bits = (qweight.view(torch.int8).to(torch.int16) << 7).bitwise_and_(~0x4000)
    return bits.view(torch.float16).float().mul_(scales[:, None] * FP8_DECODE_SCALE)


# The native decode loop (csrc/decode_loop.cpp): a whole decode step's layers in one call. Each
# linear layer hands over its weights bound to the skinny kernel that reads them; the loop then
# makes the same kernel calls as the Python layers, so the two give bit-identical results.


def float32_linear_kernel(
    weight: torch.Tensor, bias: torch.Tensor | None, prepacked: torch.Tensor | None = None
) -> object | None:
    """The native loop's handle on a float32 linear, with its packed copy when it has one
    (which then serves every product); None when the native kernels are off or the weights
    are not contiguous float32."""
    tensors = (weight,) if bias is None else (weight, bias)
    usable = all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)
    if _NATIVE is None or not usable:
        return None
    return _NATIVE.LinearKernel.float32(weight, bias, prepacked)


def int8_linear_kernel(
    panels: QuantPanels | None, group_size: int, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on an int8 linear, from its `pack_int8_panels` form."""
    if _NATIVE is None or panels is None or not (bias is None or bias.dtype == torch.float32):
        return None
    return _NATIVE.LinearKernel.int8(
        panels.values, panels.scales, panels.out_features, group_size, bias
    )


def int4_linear_kernel(
    panels: QuantPanels | None, group_size: int, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on an int4 linear, from its `pack_int4_panels` form."""
    if _NATIVE is None or panels is None or not (bias is None or bias.dtype == torch.float32):
        return None
    return _NATIVE.LinearKernel.int4(
        panels.values, panels.scales, panels.mins, panels.out_features, group_size, bias
    )


def fp8_linear_kernel(
    qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on an fp8 linear (the layout of `fp8_linear`)."""
    if _NATIVE is None or not (bias is None or bias.dtype == torch.float32):
        return None
    return _NATIVE.LinearKernel.fp8(qweight, scales, bias)


def bfloat16_linear_kernel(
    prepacked: torch.Tensor | None, out_features: int, bias: torch.Tensor | None
) -> object | None:
    """The native loop's handle on a bfloat16 linear with its packed tiles (`prepack_linear_weight`
    on a CPU with AMX or AVX512-BF16); None without them."""
    if _NATIVE is None or prepacked is None or not bfloat16_linear_available():
        return None
    if prepacked.dtype != torch.bfloat16 or not (bias is None or bias.dtype == torch.bfloat16):
        return None
    return _NATIVE.LinearKernel.bfloat16(prepacked, out_features, bias)


def linear_kernel_max_rows(kernel: Any) -> int:
    """The most rows of x the loop may hand this kernel: wider products run elsewhere (torch's
    GEMM, or the quantized weights expanded tile by tile). A float32 weight with a packed copy,
    and a bfloat16 one, take what the packed products take."""
    if (kernel.kind == "float32" and kernel.has_packed) or kernel.kind == "bfloat16":
        return PREPACKED_MAX_ROWS
    return SKINNY_MAX_ROWS if kernel.kind in ("float32", "fp8") else QUANT_KERNEL_MAX_ROWS


def decoder_layer_weights(
    input_norm: torch.Tensor,
    qkv: object,
    o: object,
    mlp_norm: torch.Tensor,
    gate_up: object,
    down: object,
    rotary: tuple[torch.Tensor, torch.Tensor],
    window: int | None,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    attention_out_norm: torch.Tensor | None = None,
    mlp_out_norm: torch.Tensor | None = None,
) -> object:
    """One decoder layer for `decode_loop`: the linears are handles from `*_linear_kernel`,
    `rotary` its (cos, sin) tables, `window` its sliding window; the last four are Gemma 3's
    extra norms (None for Llama)."""
    assert _NATIVE is not None, "decoder layers exist only with the native kernels"
    cos, sin = rotary
    return _NATIVE.DecoderLayerWeights(
        input_norm,
        qkv,
        o,
        mlp_norm,
        gate_up,
        down,
        cos,
        sin,
        window or 0,
        q_norm,
        k_norm,
        attention_out_norm,
        mlp_out_norm,
    )


def decode_loop(
    layers: list[object],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    scale: float,
    activation: str,
) -> object:
    """A stack of decoder layers run in one call, `activation` "silu" or "gelu_tanh":
    `.run(hidden, positions, kv_caches, kv_scales, slot_mapping, block_tables, seq_lens)` ->
    (last layer's output, residual)."""
    assert _NATIVE is not None, "the decode loop exists only with the native kernels"
    return _NATIVE.DecodeLoop(layers, num_heads, num_kv_heads, head_dim, eps, scale, activation)


def _quantized_fits(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """`_native_friendly` for (x, bias), spelled out: it runs for every quantized product."""
    return (
        x.dtype == torch.float32
        and x.is_cpu
        and x.dim() >= 1
        and x.shape[-1] > 0
        and not (x.requires_grad and torch.is_grad_enabled())
        and (bias is None or bias.dtype == torch.float32)
    )


def _native_friendly(tensors: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32) -> bool:
    """CPU tensors of `dtype` outside autograd: float32 is the case the native kernels implement;
    a bfloat16 model's kernels (products on AMX, norms, activation, rotary embedding, KV stores
    and decode attention) also take bfloat16.

    Runs on every call, so it sticks to the cheapest tensor attributes (`is_cpu`, not `device`).
    """
    grad_enabled = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or (grad_enabled and t.requires_grad):
            return False
    return True


def _float32_or_bfloat16(tensors: tuple[torch.Tensor, ...]) -> bool:
    """`_native_friendly` for kernels that take a float32 or a bfloat16 model's tensors, all of
    one dtype."""
    return _native_friendly(tensors, tensors[0].dtype) and tensors[0].dtype in (
        torch.float32,
        torch.bfloat16,
    )
