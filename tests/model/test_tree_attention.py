"""A draft tree verified in one pass sees exactly what each of its paths would see alone."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kv.layout import allocate_kv_caches, slot_mapping
from tokenmill.model.attention import AttentionMetadata, attention

BLOCK_SIZE = 16
TABLE = list(range(6))
# root -> 0, 1; 0 -> 2, 3; 1 -> 4; 2 -> 5
PARENTS = (-1, -1, 0, 0, 1, 2)
DRAFTS = (504, 1204, 314, 2110, 429, 3000)


def forward(model, caches, token_ids, positions, num_cached, draft_trees=None):
    num_new = len(token_ids)
    slots = slot_mapping(TABLE, BLOCK_SIZE, num_cached, num_cached + num_new)
    meta = AttentionMetadata.build(
        [num_new], [num_cached + num_new], [TABLE], BLOCK_SIZE, slots, draft_trees
    )
    with torch.inference_mode():
        return model(torch.tensor(token_ids), torch.tensor(positions), caches, meta)


@pytest.fixture(scope="module")
def context(smollm):
    """The model and its KV caches holding a short prompt but its last token (the root)."""
    prompt = smollm.tokenizer.encode("The capital of France is Paris, and the capital of")
    caches = allocate_kv_caches(smollm.config, len(TABLE), BLOCK_SIZE, torch.float32)
    forward(smollm.model, caches, prompt[:-1], list(range(len(prompt) - 1)), 0)
    return smollm.model, caches, prompt


def test_attention_over_a_tree_equals_running_each_path_separately(context):
    model, caches, prompt = context
    root = len(prompt) - 1
    tree_caches = [c.clone() for c in caches]
    depths = [1, 1, 2, 2, 2, 3]
    tree = forward(
        model,
        tree_caches,
        [prompt[-1], *DRAFTS],
        [root, *(root + d for d in depths)],
        root,
        [PARENTS],
    )
    for path in ([0, 2, 5], [0, 3], [1, 4]):
        chain = forward(
            model,
            [c.clone() for c in caches],
            [prompt[-1], *(DRAFTS[i] for i in path)],
            list(range(root, root + 1 + len(path))),
            root,
        )
        rows = [0, *(1 + i for i in path)]
        torch.testing.assert_close(tree[rows], chain, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 3], ids=["full", "sliding-window"])
def test_tree_attention_equals_each_paths_chain_attention_within_a_window(window):
    heads, kv_heads, head_dim, cached = 4, 2, 16, 10
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, len(TABLE), BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    q = torch.randn(1 + len(PARENTS), heads, head_dim, generator=gen)
    k, v = (torch.randn(1 + len(PARENTS), kv_heads, head_dim, generator=gen) for _ in range(2))

    def run(rows, draft_trees=None):
        slots = slot_mapping(TABLE, BLOCK_SIZE, cached, cached + len(rows))
        meta = AttentionMetadata.build(
            [len(rows)], [cached + len(rows)], [TABLE], BLOCK_SIZE, slots, draft_trees
        )
        return attention(q[rows], k[rows], v[rows], cache.clone(), meta, 0.25, window)

    tree = run(list(range(1 + len(PARENTS))), [PARENTS])
    for path in ([0, 2, 5], [0, 3], [1, 4]):
        rows = [0, *(1 + i for i in path)]
        torch.testing.assert_close(tree[rows], run(rows), atol=1e-5, rtol=1e-5)
