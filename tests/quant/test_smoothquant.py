"""SmoothQuant W8A8: smoothing factors, per-token activations, the layer's two routes (decode
rows on int8's panel kernel, wider ones on oneDNN's int8 GEMM), the reference switch, and the
engine on the real SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.kernels import ops
from tokenmill.kernels.w8a8_linear import int8_gemm_reference
from tokenmill.kernels.w8a8_linear import quantize_tokens_reference as quantize_tokens
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant import smoothquant
from tokenmill.quant.linear import DerivedCache
from tokenmill.quant.registry import quant_method
from tokenmill.quant.smoothquant import SmoothQuantLinear, smoothing_scales
from tokenmill.sampling.params import SamplingParams

from ..engine.test_engine import VARIED_PROMPTS, run_all

needs_native = pytest.mark.skipif(ops.backend() != "native", reason="needs the native kernels")
SCORED = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
# Log-probability gap below the best token within which the two rounding paths may pick another.
NEAR_TIE_NATS = 0.25


def test_smoothing_balances_activation_and_weight_ranges():
    activation_absmax = torch.tensor([100.0, 1.0, 4.0])
    weight_absmax = torch.tensor([1.0, 1.0, 0.25])
    scales = smoothing_scales(activation_absmax, weight_absmax, alpha=0.5)
    torch.testing.assert_close(scales, torch.tensor([10.0, 1.0, 4.0]))
    # After migration both sides share the same range per channel: sqrt(max|x| * max|w|).
    torch.testing.assert_close(activation_absmax / scales, weight_absmax * scales)


def test_tokens_round_trip_within_half_a_step():
    x = torch.randn(40, 300, generator=torch.Generator().manual_seed(0)) * 3
    x[:, 7] += 50  # an outlier channel
    codes, scales, zeros = quantize_tokens(x)
    assert codes.dtype == torch.uint8 and scales.shape == zeros.shape == (40,)
    restored = (codes.float() - zeros[:, None]) * scales[:, None]
    assert ((restored - x).abs() <= scales[:, None] / 2 + 1e-5).all()


def test_wide_product_equals_integer_arithmetic():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 96, generator=gen)
    layer = SmoothQuantLinear.from_smoothed(weight)
    assert int(layer.qweight.abs().max()) <= smoothquant.WEIGHT_MAX_CODE
    x = torch.randn(40, 96, generator=gen)
    codes, scales, zeros = quantize_tokens(x)
    weight_codes = layer.qweight
    exact = (codes.int() - zeros[:, None].int()) @ weight_codes.int().T
    expected = exact.float() * scales[:, None] * layer.scales.view(1, -1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer.dequantize(), weight_codes.float() * layer.scales[:, None])
    torch.testing.assert_close(
        int8_gemm_reference(codes, weight_codes), (codes.int() @ weight_codes.int().T).float()
    )


@pytest.mark.parametrize("rows", [1, 16, 33, 200])
def test_linear_stays_close_to_the_float_product(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(130, 200, generator=gen), torch.randn(130, generator=gen)
    layer = SmoothQuantLinear.from_smoothed(weight, bias)
    x = torch.randn(rows, 200, generator=gen)
    out, reference = layer(x), F.linear(x, weight, bias)
    assert out.shape == (rows, 130)
    assert ((out - reference).norm() / reference.norm()).item() < 0.03


@pytest.mark.parametrize("rows", [ops.W8A8_PANEL_MAX_ROWS + 1, 40])
def test_without_onednn_the_reference_gives_the_same_result(monkeypatch, rows):
    gen = torch.Generator().manual_seed(2)
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 64, generator=gen))
    x = torch.randn(rows, 64, generator=gen)
    with_onednn = layer(x)
    monkeypatch.setattr(ops, "ONEDNN_AVAILABLE", False)
    layer._gemm = DerivedCache()  # forget the oneDNN copy made above
    torch.testing.assert_close(layer(x), with_onednn, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, ops.W8A8_PANEL_MAX_ROWS])
def test_decode_rows_take_the_int8_panel_product(rows):
    """x rounded per block of 32 to int16 (int8 weights' kernel), not per token to 8 bits."""
    gen = torch.Generator().manual_seed(rows)
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 80, generator=gen), torch.randn(50))
    x = torch.randn(2, rows, 80, generator=gen)[0]
    expected = ops.int8_linear_reference(
        x, layer.qweight, layer.scales[:, None], layer.kernel_group_size, layer.bias
    )
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(ops.W8A8_PANEL_MAX_ROWS + 1, 80), (2, 30, 80)])
def test_wide_rows_give_the_reference_bit_for_bit(shape):
    gen = torch.Generator().manual_seed(4)
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 80, generator=gen), torch.randn(50))
    x = torch.randn(shape, generator=gen)
    onednn, row_sums = layer._packed()
    expected = ops.w8a8_linear_reference(
        x, layer.qweight, layer.scales, row_sums, onednn, layer.bias
    )
    assert torch.equal(layer(x), expected)


def test_reference_switch_runs_every_row_through_the_reference(monkeypatch):
    monkeypatch.setenv(smoothquant.W8A8_ENV, "reference")
    gen = torch.Generator().manual_seed(5)
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 64, generator=gen))
    assert layer.reference and layer.native_kernel() is None
    x = torch.randn(1, 64, generator=gen)
    onednn, row_sums = layer._packed()
    expected = ops.w8a8_linear_reference(x, layer.qweight, layer.scales, row_sums, onednn)
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("rows", [1, ops.W8A8_PANEL_MAX_ROWS + 1])
def test_torch_kernels_compute_the_same_function(monkeypatch, rows):
    gen = torch.Generator().manual_seed(6)
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 64, generator=gen), torch.randn(50))
    x = torch.randn(rows, 64, generator=gen)
    native = layer(x)
    monkeypatch.setattr(ops, "_NATIVE", None)
    torch.testing.assert_close(layer(x), native, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 40])
def test_wrong_input_width_raises_value_error(rows):
    layer = SmoothQuantLinear.from_smoothed(torch.randn(50, 64))
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\]"):
        layer(torch.randn(rows, 65))


def test_reloaded_codes_are_repacked():
    gen = torch.Generator().manual_seed(3)
    first = SmoothQuantLinear.from_smoothed(torch.randn(40, 64, generator=gen))
    second = SmoothQuantLinear.from_smoothed(torch.randn(40, 64, generator=gen))
    x = torch.randn(50, 64, generator=gen)
    first(x)  # packs the first codes
    with torch.no_grad():
        first.qweight.copy_(second.qweight)
        first.scales.copy_(second.scales)
    torch.testing.assert_close(first(x), second(x))


@pytest.fixture(scope="module")
def w8a8_smollm(smollm_path: Path) -> LoadedModel:
    """SmolLM2 smoothed and quantized on a small calibration set: enough to run, and quick."""
    method = quant_method("smoothquant", calib_samples=4, calib_seq_len=128)
    return load_model(str(smollm_path), torch.float32, method)


@contextmanager
def reference_layers(loaded: LoadedModel) -> Iterator[None]:
    """Every W8A8 layer on the switch's baseline (as TOKENMILL_W8A8=reference builds them)."""
    layers = [m for m in loaded.model.modules() if isinstance(m, SmoothQuantLinear)]
    for layer in layers:
        layer.reference = True
    try:
        yield
    finally:
        for layer in layers:
            layer.reference = False


def scored_run(loaded: LoadedModel, decode_loop: str) -> list[tuple[list[int], list]]:
    args = EngineArgs(model=str(loaded.path), decode_loop=decode_loop, kv_cache_memory="32MiB")
    engine = LLMEngine(args, loaded=loaded)
    assert (engine.runner.decode_loop is not None) == (decode_loop == "native")
    outputs = run_all(engine, VARIED_PROMPTS[:4], SCORED)
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]


@needs_native
def test_decode_loop_gives_the_python_layers_exact_logprobs(w8a8_smollm):
    """Four prompts decoding together, then the stragglers: every step within the panel rows."""
    assert scored_run(w8a8_smollm, "native") == scored_run(w8a8_smollm, "python")


@needs_native
def test_engine_greedy_tokens_match_the_reference_path(w8a8_smollm):
    """Decode rows round x differently on the two paths (int16 blocks, 8-bit tokens), so two
    greedy runs may part, but only where the native run's token nearly ties the reference's
    best one there."""
    native = scored_run(w8a8_smollm, "native")
    with reference_layers(w8a8_smollm):
        reference = scored_run(w8a8_smollm, "python")
    for (tokens, _), (reference_tokens, reference_logprobs) in zip(native, reference, strict=True):
        parted = next(
            (
                i
                for i, pair in enumerate(zip(tokens, reference_tokens, strict=True))
                if pair[0] != pair[1]
            ),
            None,
        )
        if parted is not None:
            top = dict(reference_logprobs[parted].top)
            best = top[reference_tokens[parted]]
            assert best - top.get(tokens[parted], float("-inf")) < NEAR_TIE_NATS


def test_prefill_logits_are_the_reference_bit_for_bit(w8a8_smollm):
    ids = w8a8_smollm.tokenizer.encode("The capital of France is a city of many bridges")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)

    def logits() -> torch.Tensor:
        with torch.inference_mode():
            hidden = w8a8_smollm.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
            return w8a8_smollm.model.compute_logits(hidden)

    native = logits()
    with reference_layers(w8a8_smollm):
        assert torch.equal(logits(), native)
