"""What each kernel call does, for the roofline report: its class (products, attention prefill /
decode, KV store, norms and activations, sampling), a label within the class, the dtype whose
compute roof applies, and its work in floating-point operations and bytes moved.

Products count their weight's bytes (what streams from memory when the weight is larger than
the caches) and 2 x rows x in x out operations. Decode attention counts the keys and values it
reads; prefill attention its causal products (gathering a cached context for it is torch
indexing, which the report counts as host time). Norms, activations, rotary embedding and KV
stores count the bytes they read and write, approximately: they are memory-bound everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.kernels import ops

PRODUCTS = "products"
ATTENTION_PREFILL = "attention prefill"
ATTENTION_DECODE = "attention decode"
KV_STORE = "kv store"
NORMS = "norms & activations"
SAMPLING = "sampling"
OTHER = "other kernels"
HOST = "host (between kernels)"
PROFILER = "profiler bookkeeping"  # the profile's own time between kernels, apart from host
CLASS_ORDER = (PRODUCTS, ATTENTION_PREFILL, ATTENTION_DECODE, KV_STORE, NORMS, SAMPLING, OTHER)

# Kernel formats whose products run integer dot products: their compute roof is the probe's
# int8 or int4 rate; every other format widens its weights to float32 and runs on that roof.
# int8 and int4 do so only up to their kernel's rows (wider, torch's float32 GEMM runs them);
# W8A8 multiplies in int8 at every width (panels, then oneDNN's int8 GEMM): its own probed rate.
INTEGER_ROOFS = {"int8": "int8", "int4": "int4", "w8a8": "w8a8"}
FLOAT_WHEN_WIDE = ("int8", "int4")
ROW_BUCKETS = ((1, "1"), (8, "2-8"), (32, "9-32"), (128, "33-128"), (512, "129-512"))


@dataclass(frozen=True)
class Work:
    """One call's class, label and roof dtype (the key it is summed under) and its work."""

    op_class: str
    label: str
    roof_dtype: str  # float32, bfloat16, int8, int4: which compute roof applies
    flops: float
    bytes: float


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rows_bucket(rows: int) -> str:
    for limit, name in ROW_BUCKETS:
        if rows <= limit:
            return name
    return f"{ROW_BUCKETS[-1][0] + 1}+"


def roof_dtype(kernel_kind: str, rows: int, kernel_max_rows: int | None = None) -> str:
    """The compute roof of a product in `kernel_kind` ("float32", "bfloat16", "int8", ...) of
    `rows` rows: past its kernel's rows a quantized product runs torch's float32 GEMM."""
    if kernel_kind == "bfloat16":
        return "bfloat16"
    if kernel_max_rows is not None and rows > kernel_max_rows:
        return "float32"
    return INTEGER_ROOFS.get(kernel_kind, "float32")


def product(kind: str, rows: int, k: int, n: int, weight_bytes: float, vocab_size: int) -> Work:
    """A product of `rows` rows, k inputs and n outputs in kernel format `kind`."""
    role = "lm_head" if n == vocab_size else "layers"
    max_rows = ops.QUANT_KERNEL_MAX_ROWS if kind in FLOAT_WHEN_WIDE else None
    label = f"{kind} {role} x{rows_bucket(rows)}"
    return Work(PRODUCTS, label, roof_dtype(kind, rows, max_rows), 2.0 * rows * k * n, weight_bytes)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


def _nbytes(*tensors: Any) -> int:
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def causal_pairs(queries: int, keys: int, window: int | None) -> int:
    """(query, key) pairs a causal chunk of `queries` at the end of `keys` attends, each query
    seeing at most `window` keys."""
    cached = keys - queries
    limit = window or keys
    full = max(0, min(queries, limit - cached))  # queries that see every key before them
    return full * cached + full * (full + 1) // 2 + (queries - full) * limit


def attended_lengths(seq_lens: torch.Tensor, window: int | None) -> int:
    lens = seq_lens.clamp(max=window) if window else seq_lens
    return int(lens.sum())


Describer = Callable[[tuple[Any, ...], Any, int], Work]


def _linear(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    x, weight = args[0], args[1]
    kind = dtype_name(weight.dtype)
    return product(kind, _rows(x), x.shape[-1], weight.shape[0], weight.nbytes, vocab)


def _integer_linear(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    fmt, x, weight = args[0], args[1], args[2]
    return product(fmt.kind, _rows(x), x.shape[-1], result.shape[-1], _nbytes(*weight), vocab)


def _named_linear(kind: str, weights: slice) -> Describer:
    def describe(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
        x = args[0]
        return product(
            kind, _rows(x), x.shape[-1], result.shape[-1], _nbytes(*args[weights]), vocab
        )

    return describe


def _decode_attention(
    q: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor, window: int | None, scales: int
) -> Work:
    heads, dim = q.shape[-2], q.shape[-1]
    kv_heads = values.shape[-2]
    tokens = attended_lengths(seq_lens, window)
    kv_bytes = tokens * 2 * kv_heads * (dim * values.element_size() + scales)
    label = f"{dtype_name(values.dtype)} kv"
    return Work(ATTENTION_DECODE, label, dtype_name(q.dtype), 4.0 * heads * dim * tokens, kv_bytes)


def _paged_decode_attention(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    q, cache, _, seq_lens = args[:4]
    window = args[5] if len(args) > 5 else None
    return _decode_attention(q, cache, seq_lens, window, 0)


def _paged_decode_attention_quantized(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    q, values, _, _, seq_lens = args[:5]
    window = args[6] if len(args) > 6 else None
    return _decode_attention(q, values, seq_lens, window, 4)  # a float32 scale per row


def _prefill_attention(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    q, k, v = args[:3]
    window = args[4] if len(args) > 4 else None
    pairs = causal_pairs(q.shape[0], k.shape[0], window)
    flops = 4.0 * q.shape[1] * q.shape[2] * pairs
    dtype = dtype_name(q.dtype)
    return Work(ATTENTION_PREFILL, dtype, dtype, flops, _nbytes(q, k, v, result))


def _store(k_index: int) -> Describer:
    def describe(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
        k, v = args[k_index], args[k_index + 1]
        return Work(KV_STORE, dtype_name(k.dtype), "", 0.0, 2.0 * _nbytes(k, v))

    return describe


def _norm(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    x, residual = args[0], args[1] if len(args) > 1 else None
    passes = 4 if residual is not None else 2
    return Work(NORMS, "rms norm", "", 0.0, passes * x.nbytes)


def _gated(name: str) -> Describer:
    def describe(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
        return Work(NORMS, name, "", 0.0, 1.5 * args[0].nbytes)

    return describe


def _rotary(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    return Work(NORMS, "rotary", "", 0.0, 2.0 * _nbytes(args[1], args[2]))


def _sampling(args: tuple[Any, ...], result: Any, vocab: int) -> Work:
    return Work(SAMPLING, "sampler", "", 0.0, 0.0)


DESCRIBERS: dict[str, Describer] = {
    "linear": _linear,
    "_linear": _integer_linear,
    "fp8_linear": _named_linear("fp8", slice(1, 3)),
    "nf4_linear": _named_linear("nf4", slice(1, 5)),
    "w8a8_linear": _named_linear("w8a8", slice(1, 2)),
    "q6_k_linear": _named_linear("q6_k", slice(1, 5)),
    "paged_decode_attention": _paged_decode_attention,
    "paged_decode_attention_quantized": _paged_decode_attention_quantized,
    "prefill_attention": _prefill_attention,
    "store_kv": _store(2),
    "store_kv_quantized": _store(3),
    "add_rms_norm": _norm,
    "silu_and_mul": _gated("silu and mul"),
    "gelu_tanh_and_mul": _gated("gelu and mul"),
    "rotary_embedding": _rotary,
    "row_argmax": _sampling,
    "apply_token_bitmask": _sampling,
    "sampling": _sampling,
}


def describe(name: str, args: tuple[Any, ...], result: Any, vocab_size: int) -> Work:
    """The work of one call of op `name`; an op without a describer counts as other kernels."""
    describer = DESCRIBERS.get(name)
    if describer is None:
        return Work(OTHER, name, "", 0.0, 0.0)
    return describer(args, result, vocab_size)
