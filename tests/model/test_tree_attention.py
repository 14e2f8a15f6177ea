"""A draft tree verified in one pass sees exactly what each of its paths would see alone: through
the paged decode path with a key mask per draft (a verify chunk), through the masked prefill (a
chunk too long for it), on SmolLM2 and on Gemma 3's sliding-window layers, and through the
native decode loop with the Python layers' bits."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import ops
from tokenmill.kv.layout import allocate_kv_caches, slot_mapping
from tokenmill.model import attention as attention_module
from tokenmill.model.attention import AttentionMetadata, attention
from tokenmill.model.decode_loop import NativeDecodeLoop

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


def prompt_context(loaded):
    """The model and its KV caches holding a short prompt but its last token (the root)."""
    prompt = loaded.tokenizer.encode("The capital of France is Paris, and the capital of")
    caches = allocate_kv_caches(loaded.config, len(TABLE), BLOCK_SIZE, torch.float32)
    forward(loaded.model, caches, prompt[:-1], list(range(len(prompt) - 1)), 0)
    return loaded.model, caches, prompt


@pytest.fixture(scope="module")
def context(smollm):
    return prompt_context(smollm)


@pytest.fixture(scope="module")
def gemma_context(gemma):
    """Gemma 3 with its local layers' window cut to 6 positions: shorter than the prompt, so
    the window hides context from every node of the tree."""
    windows = {}
    for layer in gemma.model.layers:
        if layer.self_attn.window is not None:
            windows[layer] = layer.self_attn.window
            layer.self_attn.window = 6
    yield prompt_context(gemma)
    for layer, window in windows.items():
        layer.self_attn.window = window


@pytest.mark.parametrize("path", ["decode", "prefill"], ids=["key-mask", "masked-prefill"])
@pytest.mark.parametrize("model_context", ["context", "gemma_context"], ids=["smollm2", "gemma3"])
def test_attention_over_a_tree_equals_running_each_path_separately(
    model_context, path, request, monkeypatch
):
    if path == "prefill":  # the tree's chunk too long for the decode path
        monkeypatch.setattr(attention_module, "MAX_TREE_QUERY", 0)
    model, caches, prompt = request.getfixturevalue(model_context)
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
    for branch in ([0, 2, 5], [0, 3], [1, 4]):
        chain = forward(
            model,
            [c.clone() for c in caches],
            [prompt[-1], *(DRAFTS[i] for i in branch)],
            list(range(root, root + 1 + len(branch))),
            root,
        )
        rows = [0, *(1 + i for i in branch)]
        # A wrong mask moves outputs by whole units; the tolerance covers only the products'
        # rounding, which differs between a tree's row count and a chain's once weights are
        # prepacked (another test's engine prepacks the shared model in place).
        torch.testing.assert_close(tree[rows], chain, atol=2e-4, rtol=5e-4)


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


@pytest.mark.skipif(ops.backend() != "native", reason="needs the native kernels")
def test_a_tree_verifies_through_the_native_loop_with_the_python_layers_bits(smollm, context):
    _, caches, prompt = context
    loop_caches = [c.clone() for c in caches]
    loop = NativeDecodeLoop.build(smollm.model, loop_caches)
    assert loop is not None
    root = len(prompt) - 1
    slots = slot_mapping(TABLE, BLOCK_SIZE, root, root + 1 + len(PARENTS))
    meta = AttentionMetadata.build(
        [1 + len(PARENTS)], [root + 1 + len(PARENTS)], [TABLE], BLOCK_SIZE, slots, [PARENTS]
    )
    assert loop.applies(meta) and meta.decode is not None and meta.decode.key_mask is not None
    ids = torch.tensor([prompt[-1], *DRAFTS])
    positions = torch.tensor([root, *(root + d for d in (1, 1, 2, 2, 2, 3))])
    with torch.inference_mode():
        expected = smollm.model(ids, positions, [c.clone() for c in caches], meta)
        assert torch.equal(loop(ids, positions, meta), expected)
