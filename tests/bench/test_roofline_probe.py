"""`bench roofline`'s probe: positive rates for what the machine runs, a note for what it lacks."""

from __future__ import annotations

import pytest

from tokenmill.bench.roofline.op_classes import roof_dtype
from tokenmill.bench.roofline.probe import (
    CPU_FEATURES,
    QUICK_SIZES,
    cpu_features,
    probe,
    probe_step_reads,
)
from tokenmill.kernels import ops


@pytest.fixture(scope="module")
def ceilings():
    return probe(QUICK_SIZES)


def test_bandwidth_and_every_rate_it_measured_are_positive(ceilings):
    assert ceilings.dram_read_gbps > 0 and ceilings.threads >= 1
    measured = [rate for rate in ceilings.rates if not rate.skipped]
    assert {rate.dtype for rate in measured} >= {"float32", "bfloat16"}
    assert all(rate.gflops > 0 and rate.weight_gbps > 0 for rate in measured)


def test_each_dtype_has_decode_and_prefill_shapes(ceilings):
    shapes = {(rate.dtype, rate.kernel, rate.shape) for rate in ceilings.rates}
    for dtype, kernel in [
        ("float32", "torch"),
        ("bfloat16", "torch"),
        ("int8", "tokenmill"),
        ("w8a8", "tokenmill"),
    ]:
        assert {(dtype, kernel, "decode"), (dtype, kernel, "prefill")} <= shapes


def test_the_compute_roof_of_a_dtype_is_its_best_rate(ceilings):
    best = max(r.gflops for r in ceilings.rates if r.dtype == "float32" and not r.skipped)
    assert ceilings.compute_gflops("float32") == best
    assert ceilings.compute_gflops("fp4") == 0.0


def test_the_engines_kernels_are_skipped_with_a_note_without_the_extension(monkeypatch):
    monkeypatch.setattr(ops, "_NATIVE", None)  # the torch kernels, as on a CPU without AVX2
    ceilings = probe(QUICK_SIZES)
    engine_rates = [rate for rate in ceilings.rates if rate.kernel == "tokenmill"]
    assert engine_rates and all(rate.skipped for rate in engine_rates)
    assert all(rate.seconds > 0 for rate in ceilings.rates if rate.kernel == "torch")
    assert ceilings.kernels == "torch" and ceilings.notes


def test_a_step_smaller_than_the_dram_buffer_gets_its_own_read_rate(ceilings):
    step = QUICK_SIZES.bandwidth_bytes // 8
    probe_step_reads(ceilings, step, QUICK_SIZES)
    assert ceilings.step_read_bytes == step and ceilings.step_read_gbps > 0
    assert ceilings.memory_gbps == ceilings.step_read_gbps


def test_a_step_as_large_as_the_dram_buffer_keeps_the_dram_roof():
    ceilings = probe(QUICK_SIZES)
    probe_step_reads(ceilings, QUICK_SIZES.bandwidth_bytes, QUICK_SIZES)
    assert ceilings.step_read_gbps == 0.0 and ceilings.memory_gbps == ceilings.dram_read_gbps


def test_cpu_features_are_among_the_known_ones():
    assert set(cpu_features()) <= set(CPU_FEATURES)


def test_each_rate_keeps_its_best_pass(monkeypatch):
    from dataclasses import replace

    from tokenmill.bench.roofline import probe as probe_module

    passes_timed: dict[int, int] = {}

    def slow_fast_middling(call, budget_s, *args):  # each product's three passes in turn
        key = id(args[0]) if args else 0
        passes_timed[key] = passes_timed.get(key, 0) + 1
        return [3.0, 1.0, 2.0][passes_timed[key] - 1]

    monkeypatch.setattr(probe_module, "best_seconds", slow_fast_middling)
    ceilings = probe(replace(QUICK_SIZES, passes=3))
    measured = [rate for rate in ceilings.rates if not rate.skipped]
    assert measured and {rate.seconds for rate in measured} == {1.0}


@pytest.mark.parametrize(
    ("kind", "rows", "max_rows", "roof"),
    [
        ("int8", 16, 64, "int8"),  # within its panel kernel: the int8 rate
        ("int8", 512, 64, "float32"),  # wider: torch's float32 GEMM on the widened weight
        ("w8a8", 512, None, "w8a8"),  # integer products at every width: its own probed rate
        ("bfloat16", 512, None, "bfloat16"),
        ("nf4", 512, None, "float32"),
    ],
)
def test_a_products_roof_is_the_rate_of_the_kernel_that_runs_it(kind, rows, max_rows, roof):
    assert roof_dtype(kind, rows, max_rows) == roof
