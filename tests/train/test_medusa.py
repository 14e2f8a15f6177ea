"""Medusa training examples: head k at position p learns from the target's state at p + 1 + k."""

from __future__ import annotations

import torch

from tokenmill.train.medusa import head_examples


def test_each_head_is_labelled_by_the_state_k_plus_one_positions_ahead():
    features = [torch.arange(8.0).unsqueeze(1), torch.arange(3.0).unsqueeze(1)]
    inputs, labels = head_examples(features, num_heads=3)
    # 8 positions leave 4 with every head's label inside; 3 positions leave none.
    assert inputs.squeeze(1).tolist() == [0, 1, 2, 3]
    for k, label in enumerate(labels):
        assert label.squeeze(1).tolist() == [p + 1 + k for p in range(4)]
