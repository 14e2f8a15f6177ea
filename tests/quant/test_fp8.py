"""fp8 (e4m3) weights: rounding error, a linear that matches its reference, the real model (its
kernels: tests/kernels/test_fp8_linear.py)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.bench.evaluate import model_weight_bytes
from tokenmill.kernels import ops
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.fp8 import FP8_DTYPE, Fp8Linear, quantize_fp8
from tokenmill.quant.registry import quant_method


def test_quantization_error_is_within_half_a_mantissa_step():
    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    codes, scales = quantize_fp8(weight)
    assert codes.dtype == FP8_DTYPE and scales.shape == (64,)
    restored = ops.dequantize_fp8_reference(codes, scales)
    normal = weight.abs() > 2**-6 * 448 * scales[:, None]  # e4m3's normal range, per row
    relative = ((restored - weight).abs() / weight.abs())[normal]
    assert relative.max() <= 2**-4 + 1e-6  # 3 mantissa bits
    torch.testing.assert_close(restored.abs().amax(dim=1), weight.abs().amax(dim=1))


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_linear_matches_its_dequantized_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(700, 130, generator=gen), torch.randn(700, generator=gen)
    layer = Fp8Linear.from_float(weight, bias)
    x = torch.randn(rows, 130, generator=gen)
    torch.testing.assert_close(layer(x), F.linear(x, layer.dequantize(), bias))
    assert model_weight_bytes(layer) == 700 * 130 + 700 * 4 + 700 * 4  # codes, scales, bias


def log_probs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        return F.log_softmax(loaded.model.compute_logits(hidden), dim=-1)


def test_model_answers_paris_and_stays_close(smollm, quantized_smollm, long_text):
    loaded = quantized_smollm("fp8")
    prompt = smollm.tokenizer.encode("The capital of France is")
    assert smollm.tokenizer.decode([int(log_probs(loaded, prompt)[-1].argmax())]) == " Paris"
    ids = smollm.tokenizer.encode(long_text)[:128]
    reference, quantized = log_probs(smollm, ids), log_probs(loaded, ids)
    # e4m3 keeps 3 mantissa bits: weights move by ~2.5% rms, about 3x int8's rounding.
    assert (reference.exp() * (reference - quantized)).sum(dim=-1).mean() < 0.08


def test_fp8_takes_no_group_size():
    with pytest.raises(ValueError, match="'fp8' takes no option group_size"):
        quant_method("fp8", group_size=32)
