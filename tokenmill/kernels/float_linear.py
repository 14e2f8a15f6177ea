"""Products with a float32 or bfloat16 weight: which kernel takes how many rows of x, and the
packed copy of a weight that the batched kernels read.

The native kernels: the skinny kernel streams the plain weight once for a few rows of x
(csrc/linear.cpp); the packed kernel reads a copy regrouped for batches (csrc/packed_linear.cpp);
a bfloat16 weight's packed tiles run on AMX, AVX512-BF16 or float32 FMAs on the widened weights
(csrc/bfloat16_linear.cpp). Under torch's kernels a packed copy is oneDNN's blocked format.
Wider batches run torch's GEMM.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch.nn import functional as F

from tokenmill.kernels.dispatch import native_friendly, native_or
from tokenmill.kernels.extension import INTEL_CPU, bfloat16_products

# Above this many rows of x, MKL's blocked GEMM beats a kernel that streams the weights once
# (measured over SmolLM2's layer products with the weights read from DRAM).
SKINNY_MAX_ROWS = 32
# Up to this many rows of x, a GEMM on a copy of the weight packed for it (`prepack_linear_weight`)
# beats MKL's on the plain weight; above, MKL is ahead. The copy is the native blocked kernel's
# panels, which beat oneDNN's over that range, or oneDNN's blocked format under torch's kernels.
# A bfloat16 weight's tiles (AMX) cross over to torch's bfloat16 GEMM at the same bound.
PREPACKED_MAX_ROWS = 256
# MKL takes its fast paths on Intel CPUs only. Elsewhere a float32 product of any number of rows
# runs faster on the packed copy than on MKL's plain-weight GEMM, so there every float32 product
# with a packed copy takes it.
FLOAT32_PREPACKED_MAX_ROWS = PREPACKED_MAX_ROWS if INTEL_CPU else sys.maxsize
# Whether the widening path's tiles run in zmm: torch finds AVX-512 (F, BW, VL, DQ, as the native
# kernels ask) and TOKENMILL_AVX512 allows it.
_AVX512_TILES = (
    torch.backends.cpu.get_cpu_capability() == "AVX512"
    and os.environ.get("TOKENMILL_AVX512") != "0"
)
# A bfloat16 weight's packed tiles take products up to this many rows. On AMX and the dot
# products torch's bfloat16 GEMM is ahead past PREPACKED_MAX_ROWS. The widening path's zmm tiles
# run faster than torch's GEMM at every width (SmolLM2's products at 300 to 2,048 rows), so there
# the packed tiles take every product; its ymm tiles keep the bound (they were measured only
# against a torch GEMM that ran AVX512-BF16 itself, which was ahead of them from 64 rows on).
BFLOAT16_PREPACKED_MAX_ROWS = (
    sys.maxsize if bfloat16_products() == "widen" and _AVX512_TILES else PREPACKED_MAX_ROWS
)
# Under torch's kernels, up to this many rows MKL's product on the plain weight streams faster
# than oneDNN's GEMM on the packed copy, where the CPU is an Intel one with AVX-512 (measured
# over all of SmolLM2's products; with AVX2 the packed copy was ahead from one row). Off Intel,
# MKL's one-row products are slower than oneDNN's whatever the threads, so the copy serves all.
TORCH_PLAIN_MAX_ROWS = 3 if torch.backends.cpu.get_cpu_capability() == "AVX512" and INTEL_CPU else 0
# Up to this many rows of x, the skinny kernel on a bfloat16 weight without packed tiles (widened
# to float32 as it is read) beats torch's bfloat16 product (oneDNN, with AMX), whose time barely
# changes with the number of rows; past it torch's is ahead.
BFLOAT16_SKINNY_MAX_ROWS = 4


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1) if x.dim() >= 1 else 0


def _packed_fits(x: torch.Tensor, prepacked: torch.Tensor | None, rows: int) -> bool:
    """Whether a product of `rows` rows of x runs on the packed copy: one exists, autograd is
    not recording x, and the rows are within the packed kernels' limit for x's dtype."""
    inference = not (x.requires_grad and torch.is_grad_enabled())
    bfloat16 = x.dtype == torch.bfloat16
    max_rows = BFLOAT16_PREPACKED_MAX_ROWS if bfloat16 else FLOAT32_PREPACKED_MAX_ROWS
    return prepacked is not None and inference and rows <= max_rows


def _torch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prepacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """`linear` under torch's kernels: oneDNN on the packed copy from past TORCH_PLAIN_MAX_ROWS
    up to FLOAT32_PREPACKED_MAX_ROWS rows, else torch's GEMM on the plain weight."""
    rows = _rows(x)
    if _packed_fits(x, prepacked, rows) and rows > TORCH_PLAIN_MAX_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, prepacked, bias, "none", [], "")
    return linear_reference(x, weight, bias)


@native_or(_torch_linear)
def linear(
    native: ModuleType,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    prepacked: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear` (x: [..., K], weight: [N, K], bias: [N]). With the native kernels: the packed
    kernel on `prepacked` (from `prepack_linear_weight`) up to FLOAT32_PREPACKED_MAX_ROWS rows of
    x, else the skinny kernel on the plain weight up to SKINNY_MAX_ROWS. With torch's: oneDNN on
    `prepacked` from past TORCH_PLAIN_MAX_ROWS up to FLOAT32_PREPACKED_MAX_ROWS. A bfloat16
    weight: its packed tiles (`prepacked`) up to BFLOAT16_PREPACKED_MAX_ROWS, else (no tiles)
    the skinny kernel up to BFLOAT16_SKINNY_MAX_ROWS, their outputs rounded to bfloat16 as
    torch's are. Everything else: torch's GEMM on the plain weight."""
    rows = _rows(x)
    packed_fits = _packed_fits(x, prepacked, rows)
    if packed_fits and rows >= 1 and native_friendly((x,)):
        n = weight.shape[0]
        return _flat_rows(native.packed_linear, x, n, prepacked, n, bias)
    if packed_fits and rows >= 1 and native_friendly((x,), torch.bfloat16):
        n = weight.shape[0]
        return _flat_rows(native.bfloat16_linear, x, n, prepacked, n, bias)
    if _skinny_linear_fits(x, weight, bias):
        return _flat_rows(native.linear, x, weight.shape[0], weight, bias)
    if _skinny_linear_fits(x, weight, bias, BFLOAT16_SKINNY_MAX_ROWS, torch.bfloat16):
        wide_bias = None if bias is None else bias.float()
        out = _flat_rows(native.linear, x.float(), weight.shape[0], weight, wide_bias)
        return out.to(torch.bfloat16)
    return linear_reference(x, weight, bias)


def _flat_rows(
    kernel: Callable[..., torch.Tensor], x: torch.Tensor, n: int, *args: Any
) -> torch.Tensor:
    """`kernel(x2d, *args)` on x's rows flattened to [M, K], shaped back to [..., n]."""
    if x.dim() == 2:  # the usual flat batch; reshaping costs more than the kernel call
        return kernel(x, *args)
    return kernel(x.reshape(-1, x.shape[-1]), *args).view(*x.shape[:-1], n)


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
        and native_friendly(tensors, dtype)
    )


def _onednn_prepack(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """`prepack_linear_weight` under torch's kernels: oneDNN's blocked copy of a float32 weight."""
    if not (weight.dtype == torch.float32 and weight.is_cpu):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


@native_or(_onednn_prepack)
def prepack_linear_weight(
    native: ModuleType, weight: torch.Tensor, batch_hint: int
) -> torch.Tensor | None:
    """A copy of a float32 weight [N, K] laid out for batched products: the native blocked
    kernel's panels, or under torch's kernels oneDNN's blocked format for about `batch_hint` rows
    of x. None where neither applies (torch without oneDNN, a weight not float32 on the CPU). The
    copy is extra memory: the plain weight stays for the other paths. A bfloat16 weight, where
    the native kernels load: the tiles `bfloat16_linear` reads."""
    if weight.dtype == torch.bfloat16 and weight.is_cpu:
        with torch.no_grad():
            return native.pack_bfloat16_weight(weight.detach())
    if not (weight.dtype == torch.float32 and weight.is_cpu):
        return None
    with torch.no_grad():
        return native.pack_linear_weight(weight.detach())
