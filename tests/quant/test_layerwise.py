"""Layer-at-a-time calibration runs sees exactly what the whole model computes."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant import layerwise
from tokenmill.quant.layerwise import LAYER_LINEARS, LayerInputs


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_layer_by_layer_matches_the_full_forward_pass(smollm, monkeypatch, one_thread):
    # Three chunks of two sequences: 40 rows each, like the full pass's 120 wider than the skinny
    # kernels, so both multiply through the same GEMM. With several threads the GEMM splits 40
    # and 120 rows differently, and the sums' order with them: one thread keeps it the same.
    monkeypatch.setattr(layerwise, "CHUNK_TOKENS", 40)
    samples = torch.randint(100, 40000, (6, 20), generator=torch.Generator().manual_seed(0))
    inputs = LayerInputs(smollm.model, samples)
    for layer in smollm.model.layers:
        inputs.advance(layer)
    meta = AttentionMetadata.build([20] * 6, [20] * 6, None, 16, None)
    with torch.inference_mode():
        expected = smollm.model(samples.reshape(-1), torch.arange(20).repeat(6), None, meta)
    torch.testing.assert_close(inputs.final_hidden(smollm.model.norm), expected)


def test_observers_see_every_row_and_run_leaves_the_inputs(smollm):
    samples = torch.randint(100, 40000, (3, 16), generator=torch.Generator().manual_seed(1))
    inputs = LayerInputs(smollm.model, samples)
    layer = smollm.model.layers[0]
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in LAYER_LINEARS}
    before = inputs.hidden.clone()
    inputs.run(layer, {name: seen[name].append for name in LAYER_LINEARS})
    assert torch.equal(inputs.hidden, before) and inputs.residual is None
    for name in LAYER_LINEARS:
        rows = torch.cat(seen[name])
        assert rows.shape == (48, layer.get_submodule(name).in_features)
    assert not layer.self_attn.qkv_proj._forward_pre_hooks  # hooks are removed afterwards


def test_samples_must_be_a_matrix_of_token_ids(smollm):
    with pytest.raises(ValueError, match="samples must be"):
        LayerInputs(smollm.model, torch.tensor([1, 2, 3]))
