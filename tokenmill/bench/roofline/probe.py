"""The machine's ceilings for the roofline report: DRAM read bandwidth and the product rates of
each dtype at decode shapes (a few rows against a weight larger than the caches) and prefill
shapes (hundreds of rows), with the threads the engine uses.

A model whose weights fit in the last-level cache reads them from the cache every step, faster
than DRAM: its memory roof is the read rate of a buffer as large as one step's reads
(`probe_step_reads`, measured once the profile says how large that is).

fp32 and bf16 products are timed on torch's GEMM and on the engine's own kernels; int8 and
int4 on the engine's panel kernels, which are what a quantized model runs; W8A8 (SmoothQuant)
on its layer as a model runs it: the int8 panels for decode rows, and for prefill rows the
per-token quantization, oneDNN's int8 GEMM and the rescale, all three timed as one product. A
rate the build cannot run (no native extension) is skipped with a note. Each rate is the best
of repeated calls over a short time budget, and the whole probe runs several passes, keeping
each rate's best: a rate stays a ceiling when something else runs on the machine for a moment,
where a single pass read a whole roof low.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.smoothquant import SmoothQuantLinear

# What each path of the engine's bfloat16 products (TOKENMILL_BF16_PRODUCTS) runs on.
BFLOAT16_PATHS = {
    "amx": "AMX tiles",
    "dot": "AVX512-BF16 dot products",
    "widen": "float32 FMAs on the widened weights",
}
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


@dataclass(frozen=True)
class ProbeSizes:
    """How big and how long the probe runs; the defaults take a few seconds in all."""

    bandwidth_bytes: int = 512 * 2**20  # well past any last-level cache
    decode_in: int = 4096  # the decode shapes' weight [decode_out, decode_in]
    decode_out: int = 4096
    decode_rows: tuple[int, ...] = (1, 4)
    prefill_size: int = 2048  # the prefill shapes' weight is square
    prefill_rows: int = 256
    seconds_per_rate: float = 0.1
    passes: int = 3  # every rate is timed once a pass, passes interleaved; the best counts


QUICK_SIZES = ProbeSizes(
    bandwidth_bytes=32 * 2**20,
    decode_in=512,
    decode_out=1024,
    decode_rows=(1,),
    prefill_size=256,
    prefill_rows=64,
    seconds_per_rate=0.01,
    passes=1,
)


@dataclass
class ProductRate:
    """One product timed: `rows` x [in_features] against a weight [out_features, in_features]."""

    dtype: str  # float32, bfloat16, int8, int4, w8a8
    kernel: str  # torch, or tokenmill (the engine's own)
    shape: str  # decode or prefill
    rows: int
    in_features: int
    out_features: int
    weight_bytes: int = 0
    seconds: float = 0.0
    skipped: str = ""  # why this rate was not measured; "" when it was

    @property
    def gflops(self) -> float:
        flops = 2 * self.rows * self.in_features * self.out_features
        return flops / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def weight_gbps(self) -> float:
        return self.weight_bytes / self.seconds / 1e9 if self.seconds else 0.0


@dataclass
class Ceilings:
    """What the probe measured: the roofs every op class is compared with."""

    threads: int
    cpu_capability: str  # torch's view: AVX2, AVX512, ...
    cpu_features: list[str]
    kernels: str  # native or torch
    dram_read_gbps: float
    rates: list[ProductRate] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # One step's reads of the profiled run and the rate a buffer of that size reads at; 0 when
    # not measured (the reads are at least the DRAM probe's buffer, or no profile ran).
    step_read_bytes: int = 0
    step_read_gbps: float = 0.0

    @property
    def memory_gbps(self) -> float:
        """The memory roof: the step-sized buffer's read rate where measured, else DRAM's."""
        return self.step_read_gbps or self.dram_read_gbps

    def compute_gflops(self, dtype: str) -> float:
        """The best product rate measured in `dtype` (0 when none ran): its compute roof."""
        measured = [r.gflops for r in self.rates if r.dtype == dtype and not r.skipped]
        return max(measured, default=0.0)

    @classmethod
    def from_dict(cls, data: dict) -> Ceilings:
        rates = [ProductRate(**rate) for rate in data.get("rates", [])]
        return cls(**{**data, "rates": rates})


def cpu_features() -> list[str]:
    """The SIMD features of CPU_FEATURES that Linux reports (empty where it does not say)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return []
    present = set(flags.partition(":")[2].split())
    return [name for name in CPU_FEATURES if name in present]


def best_seconds(call: Callable[..., object], budget_s: float, *args: object) -> float:
    """The fastest of repeated `call(*args)` (after one warm-up) within about `budget_s`."""
    call(*args)
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        call(*args)
        elapsed = time.perf_counter() - start
        best = min(best, elapsed)
        if start + elapsed >= deadline:
            return best


def read_gbps(num_bytes: int, budget_s: float, passes: int = 1) -> float:
    """Bytes per second that a sum over a buffer of `num_bytes` reads, with torch's threads:
    the best of `passes` timings (after a warm-up, so a buffer that fits in a cache is read
    from it)."""
    buffer = torch.ones(max(num_bytes // 4, 1), dtype=torch.float32)
    seconds = min(best_seconds(buffer.sum, budget_s) for _ in range(max(passes, 1)))
    return buffer.nbytes / seconds / 1e9


def probe_step_reads(
    ceilings: Ceilings, step_read_bytes: int, sizes: ProbeSizes = ProbeSizes()
) -> None:
    """Measures the read rate of a buffer of one step's reads into `ceilings`, where those are
    smaller than the DRAM probe's buffer (larger ones read from DRAM: its rate stands)."""
    if not 0 < step_read_bytes < sizes.bandwidth_bytes:
        return
    ceilings.step_read_bytes = step_read_bytes
    ceilings.step_read_gbps = read_gbps(step_read_bytes, 2 * sizes.seconds_per_rate, sizes.passes)


def probe(sizes: ProbeSizes = ProbeSizes()) -> Ceilings:
    """Measures the ceilings with the threads torch (and so the engine) uses."""
    ceilings = Ceilings(
        threads=torch.get_num_threads(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        cpu_features=cpu_features(),
        kernels=ops.backend(),
        dram_read_gbps=read_gbps(sizes.bandwidth_bytes, 2 * sizes.seconds_per_rate, sizes.passes),
    )
    if os.environ.get("TOKENMILL_AVX512") == "0":
        ceilings.notes.append("TOKENMILL_AVX512=0: the engine's kernels run their AVX2 paths")
    products = ops.bfloat16_products()
    if products is not None:
        path = BFLOAT16_PATHS.get(products, products)
        ceilings.notes.append(f"the engine's bfloat16 products run on {path}")
    generator = torch.Generator().manual_seed(0)
    shapes = [
        ("decode", sizes.decode_rows, sizes.decode_in, sizes.decode_out),
        ("prefill", (sizes.prefill_rows,), sizes.prefill_size, sizes.prefill_size),
    ]
    timed = []
    for shape, rows, k, n in shapes:
        weight = torch.randn(n, k, generator=generator) / k**0.5
        x = torch.randn(max(rows), k, generator=generator)
        timed.extend(_timed_products(shape, rows, weight, x))
    for _ in range(max(sizes.passes, 1)):
        for rate, run, x in timed:
            if run is not None:
                with torch.inference_mode():
                    seconds = best_seconds(run, sizes.seconds_per_rate, x)
                rate.seconds = min(rate.seconds or seconds, seconds)
    for rate, _, _ in timed:
        ceilings.rates.append(rate)
        if rate.skipped and rate.skipped not in ceilings.notes:
            ceilings.notes.append(rate.skipped)
    return ceilings


def _timed_products(
    shape: str, rows: tuple[int, ...], weight: torch.Tensor, x: torch.Tensor
) -> list[tuple[ProductRate, Callable[[torch.Tensor], object] | None, torch.Tensor | None]]:
    """Every product of _PRODUCTS on `weight`, made once, at each of `rows`: its rate to fill
    in, the call to time (None when skipped) and the rows to time it on."""
    n, k = weight.shape
    timed = []
    for dtype, kernel, make in _PRODUCTS:
        with torch.no_grad():  # weights made under inference_mode could not be prepacked
            product = make(weight)
        for count in rows:
            rows_run = min(count, product.max_rows)
            rate = ProductRate(dtype, kernel, shape, rows_run, k, n, product.weight_bytes)
            if product.run is None:
                rate.skipped = product.skipped
                timed.append((rate, None, None))
            else:
                timed.append((rate, product.run, x[:rows_run].to(product.dtype)))
    return timed


@dataclass(frozen=True)
class Product:
    """A weight made ready for one kernel: `run(x)` with x of `dtype`, up to `max_rows` rows
    (wider products run elsewhere); `run` None with the reason in `skipped`."""

    run: Callable[[torch.Tensor], object] | None
    dtype: torch.dtype = torch.float32
    weight_bytes: int = 0
    max_rows: int = 1 << 30
    skipped: str = ""


def _torch_float32(weight: torch.Tensor) -> Product:
    return Product(lambda x: F.linear(x, weight), torch.float32, weight.nbytes)


def _torch_bfloat16(weight: torch.Tensor) -> Product:
    w = weight.bfloat16()
    return Product(lambda x: F.linear(x, w), torch.bfloat16, w.nbytes)


def _engine_linear(dtype: torch.dtype) -> Callable[[torch.Tensor], Product]:
    """The engine's float kernel as a model's Linear runs it: on its packed copy."""

    def make(weight: torch.Tensor) -> Product:
        if ops.backend() != "native":
            return Product(None, skipped="tokenmill kernels: the native extension is not loaded")
        layer = Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
        layer.weight.data.copy_(weight)
        layer.prepack(ops.PREPACKED_MAX_ROWS)
        return Product(layer, dtype, layer.weight.nbytes, ops.PREPACKED_MAX_ROWS)

    return make


def _engine_quantized(cls: type[Int8Linear] | type[Int4Linear]) -> Callable[..., Product]:
    """The engine's integer panel kernel (VNNI on AVX-512, AVX2 otherwise); wider products than
    it takes expand the weight to float32 and run torch's GEMM."""

    def make(weight: torch.Tensor) -> Product:
        if ops.backend() != "native":
            return Product(None, skipped=f"{cls.kind}: the native extension is not loaded")
        layer = cls.from_float(weight)
        layer.prepare()
        weight_bytes = sum(p.nbytes for p in layer.parameters())
        return Product(layer, torch.float32, weight_bytes, ops.QUANT_KERNEL_MAX_ROWS)

    return make


def _engine_w8a8(weight: torch.Tensor) -> Product:
    """A SmoothQuant layer (no smoothing: the probe's weight has no outlier channels to move)."""
    if ops.backend() != "native":
        return Product(None, skipped="w8a8: the native extension is not loaded")
    layer = SmoothQuantLinear.from_smoothed(weight)
    layer.prepare()
    return Product(layer, torch.float32, layer.qweight.nbytes)


_PRODUCTS: list[tuple[str, str, Callable[[torch.Tensor], Product]]] = [
    ("float32", "torch", _torch_float32),
    ("float32", "tokenmill", _engine_linear(torch.float32)),
    ("bfloat16", "torch", _torch_bfloat16),
    ("bfloat16", "tokenmill", _engine_linear(torch.bfloat16)),
    ("int8", "tokenmill", _engine_quantized(Int8Linear)),
    ("int4", "tokenmill", _engine_quantized(Int4Linear)),
    ("w8a8", "tokenmill", _engine_w8a8),
]
