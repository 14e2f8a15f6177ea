"""Perplexity, KL and top-1 agreement of a model against a reference on held-out windows."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.bench.evaluate import model_weight_bytes
from tokenmill.bench.quality import measure_quality
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.calibration import token_windows


@pytest.fixture(scope="module")
def windows(smollm) -> torch.Tensor:
    return token_windows(smollm.tokenizer, "heldout", 3, 40)


def test_a_model_against_itself_diverges_nowhere(smollm, windows):
    quality = measure_quality(smollm.model, smollm.model, windows)
    assert quality.kl_divergence == 0.0 and quality.top1_agreement == 1.0


def test_perplexity_is_the_exponent_of_the_mean_next_token_loss(smollm, windows):
    losses = []
    for window in windows.tolist():
        meta = AttentionMetadata.build([len(window)], [len(window)], None, 16, None)
        with torch.inference_mode():
            hidden = smollm.model(torch.tensor(window), torch.arange(len(window)), None, meta)
            logits = smollm.model.compute_logits(hidden)
        losses.append(F.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="none"))
    expected = torch.cat(losses).mean().exp().item()
    quality = measure_quality(smollm.model, smollm.model, windows)
    assert quality.perplexity == pytest.approx(expected, rel=1e-4)


def test_quantized_rows_compare_against_the_baseline(smollm, quantized_smollm, windows):
    int8 = measure_quality(smollm.model, quantized_smollm("int8").model, windows)
    assert 0.0 < int8.kl_divergence < 0.02 and int8.top1_agreement > 0.9
    assert model_weight_bytes(quantized_smollm("int8").model) < model_weight_bytes(smollm.model)
