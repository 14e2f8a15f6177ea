"""The kernel timing hook a profile installs (kernels/op_timer.py): what it reports, and that
an op inside another op counts as its caller's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenmill.kernels import op_timer, ops


class ListRecorder:
    """Keeps every report as it came."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, float]] = []
        self.loops: list[dict[str, float]] = []

    def op(self, name: str, args: tuple[Any, ...], result: Any, seconds: float) -> None:
        self.ops.append((name, seconds))

    def decode_loop(
        self, owner: object, args: tuple[Any, ...], op_seconds: dict[str, float], seconds: float
    ) -> None:
        self.loops.append(op_seconds)


@pytest.fixture
def recorder():
    recorder = ListRecorder()
    op_timer.install(recorder)
    yield recorder
    op_timer.install(None)


def test_each_op_call_reports_its_name_and_time(recorder):
    x = torch.randn(2, 64)
    weight = torch.randn(32, 64)
    out = ops.linear(x, weight)
    ops.silu_and_mul(out)
    assert [name for name, _ in recorder.ops] == ["linear", "silu_and_mul"]
    assert all(seconds > 0 for _, seconds in recorder.ops)


def test_an_op_called_inside_another_counts_as_its_callers(recorder):
    """A wide int8 product expands its weight (`_dequantize`, an op itself) and runs torch's
    GEMM: one report, the product's."""
    weight = torch.randn(64, 64)
    qweight = torch.randint(-127, 127, (64, 64), dtype=torch.int8)
    scales = weight.abs().amax(dim=1, keepdim=True) / 127
    ops.int8_linear(torch.randn(ops.QUANT_KERNEL_MAX_ROWS + 8, 64), qweight, scales, 64)
    assert [name for name, _ in recorder.ops] == ["_linear"]


def test_no_recorder_means_no_reports():
    recorder = ListRecorder()
    op_timer.install(recorder)
    op_timer.install(None)
    ops.linear(torch.randn(2, 8), torch.randn(4, 8))
    assert recorder.ops == []
