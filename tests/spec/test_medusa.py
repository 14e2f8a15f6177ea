"""Medusa drafting: confidence trees from the heads' top tokens, and the shipped heads' file.
Engine-level exactness with trees is tests/spec/test_tree_drafters.py's."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.draft_tree import depths
from tokenmill.spec.medusa import (
    PACKAGED_MEDUSA_HEADS,
    MedusaHeads,
    confident_tree,
    fused_blocks,
    load_medusa_heads,
    save_medusa_heads,
)
from tokenmill.spec.setup import head_path

SHIPPED = PACKAGED_MEDUSA_HEADS["smollm2-135m-instruct"]


def test_fused_blocks_give_each_heads_features():
    torch.manual_seed(0)
    heads = MedusaHeads(64, num_heads=3, draft_vocab_size=8)
    for block in heads.blocks:
        torch.nn.init.normal_(block.weight, std=0.1)
        torch.nn.init.normal_(block.bias, std=0.1)
    hidden = torch.randn(64)
    with torch.inference_mode():
        expected = heads(hidden.unsqueeze(0)).squeeze(1)
        branches = fused_blocks(heads)(hidden.unsqueeze(0)).view(3, -1)
        fused = hidden + torch.nn.functional.silu(branches)
    torch.testing.assert_close(fused, expected)


def test_a_confident_tree_drafts_the_best_scoring_paths_parents_first():
    tokens = [[1, 2], [3, 4], [5, 6]]
    probs = [[0.9, 0.1], [0.6, 0.4], [0.5, 0.5]]
    drafts, parents = confident_tree(tokens, probs, size=4)
    # scores: 1 (.9), 1-3 (.54), 1-4 (.36), 1-3-5 (.27) beat 2 (.1)
    assert drafts == [1, 3, 4, 5]
    assert parents == [-1, 0, 0, 1]
    assert depths(parents) == [1, 2, 2, 3]


def test_a_confident_tree_leaves_out_candidates_scoring_below_the_floor():
    tokens = [[1, 2], [3, 4], [5, 6]]
    probs = [[0.9, 0.1], [0.6, 0.4], [0.5, 0.5]]
    drafts, parents = confident_tree(tokens, probs, size=4, min_score=0.3)
    assert drafts == [1, 3, 4]  # 1-3-5 (.27) and 2 (.1) score below it
    assert parents == [-1, 0, 0]


def test_the_default_model_finds_its_shipped_heads(smollm_path):
    args = EngineArgs(model=str(smollm_path), speculative_method="medusa")
    assert head_path(args, PACKAGED_MEDUSA_HEADS, "train-medusa") == SHIPPED
    assert SHIPPED.stat().st_size <= 8 * 2**20


def test_heads_for_another_shape_are_refused(smollm, tmp_path):
    path = tmp_path / "small.safetensors"
    save_medusa_heads(MedusaHeads(64, num_heads=2, draft_vocab_size=8), path, "other")
    with pytest.raises(ValueError, match="do not fit"):
        load_medusa_heads(path, smollm.config, torch.float32)
