"""Draft models on the real SmolLM2: an early exit shares the target's weights and KV, a
separate draft model has KV of its own, and a draft that does not fit is refused."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kv.layout import allocate_kv_caches, kv_bytes_per_token
from tokenmill.spec.draft_model import early_exit_draft, load_draft_model


def test_an_early_exit_runs_the_targets_first_layers_and_head(smollm):
    draft = load_draft_model("self:layers=4", smollm, torch.float32)
    assert draft.shares_target_kv and draft.config.num_hidden_layers == 4
    assert all(a is b for a, b in zip(draft.model.layers, smollm.model.layers[:4], strict=False))
    assert draft.model.lm_head is smollm.model.lm_head
    assert draft.kv_bytes_per_token(torch.float32) == 0


def test_an_early_exit_reads_and_writes_the_targets_first_layer_caches(smollm):
    draft = early_exit_draft(smollm, 3)
    target_caches = allocate_kv_caches(smollm.config, 4, 16, torch.float32)
    caches = draft.kv_caches(target_caches, 4, 16)
    assert len(caches) == 3 and all(a is b for a, b in zip(caches, target_caches, strict=False))


@pytest.mark.parametrize("num_layers", [0, 30])
def test_an_early_exit_needs_fewer_layers_than_the_target(smollm, num_layers):
    with pytest.raises(ValueError, match="1 <= N < 30"):
        early_exit_draft(smollm, num_layers)


def test_an_early_exit_cannot_be_quantized(smollm):
    with pytest.raises(ValueError, match="draft_quantization"):
        load_draft_model("self:layers=4", smollm, torch.float32, "int4")


def test_a_separate_draft_model_has_kv_of_its_own(smollm, smollm_path):
    draft = load_draft_model(str(smollm_path), smollm, torch.float32)
    assert not draft.shares_target_kv
    assert draft.kv_bytes_per_token(torch.float32) == kv_bytes_per_token(
        smollm.config, torch.float32
    )
    target_caches = allocate_kv_caches(smollm.config, 4, 16, torch.float32)
    caches = draft.kv_caches(target_caches, 4, 16)
    assert len(caches) == smollm.config.num_hidden_layers
    assert not any(a is b for a, b in zip(caches, target_caches, strict=True))


def test_a_draft_model_with_another_vocabulary_is_refused(smollm):
    with pytest.raises(ValueError, match="vocabulary"):
        load_draft_model("gemma3-270m", smollm, torch.float32)
