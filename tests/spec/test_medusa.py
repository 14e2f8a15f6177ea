"""Medusa drafting: confidence trees, and the shipped heads verified as trees leave greedy and
seeded output unchanged, alone, in a batch and across preemption."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.draft_tree import depths
from tokenmill.sampling.params import SamplingParams
from tokenmill.spec.medusa import (
    PACKAGED_MEDUSA_HEADS,
    MedusaHeads,
    confident_tree,
    load_medusa_heads,
    save_medusa_heads,
)
from tokenmill.spec.setup import head_path

GREEDY = SamplingParams(temperature=0, max_tokens=32)
SHIPPED = PACKAGED_MEDUSA_HEADS["smollm2-135m-instruct"]
TREE = {"speculative_method": "medusa", "num_speculative_tokens": 8}


def test_a_confident_tree_drafts_the_best_scoring_paths_parents_first():
    tokens = [[1, 2], [3, 4], [5, 6]]
    probs = [[0.9, 0.1], [0.6, 0.4], [0.5, 0.5]]
    drafts, parents = confident_tree(tokens, probs, size=4)
    # scores: 1 (.9), 1-3 (.54), 1-4 (.36), 1-3-5 (.27) beat 2 (.1)
    assert drafts == [1, 3, 4, 5]
    assert parents == [-1, 0, 0, 1]
    assert depths(parents) == [1, 2, 2, 3]


def test_the_default_model_finds_its_shipped_heads(smollm_path):
    args = EngineArgs(model=str(smollm_path), speculative_method="medusa")
    assert head_path(args, PACKAGED_MEDUSA_HEADS, "train-medusa") == SHIPPED
    assert SHIPPED.stat().st_size <= 8 * 2**20


def test_heads_for_another_shape_are_refused(smollm, tmp_path):
    path = tmp_path / "small.safetensors"
    save_medusa_heads(MedusaHeads(64, num_heads=2, draft_vocab_size=8), path, "other")
    with pytest.raises(ValueError, match="do not fit"):
        load_medusa_heads(path, smollm.config, torch.float32)


def test_greedy_tokens_equal_plain_decoding_and_tree_drafts_are_accepted(runner):
    prompts = [
        runner.chat("Explain how a refrigerator keeps food cold."),
        runner.chat("Write a haiku about autumn."),
    ]
    expected = runner.tokens(prompts, GREEDY)
    engine = runner.engine(**TREE)
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    metrics = outputs[0].metrics.spec_decode
    assert metrics.num_verify_steps > 0
    assert metrics.mean_accepted_length > 1.05


def test_greedy_batch_of_eight_equals_plain_decoding(runner):
    topics = ("rivers", "owls", "clocks", "bread", "tides", "chess", "bees", "maps")
    prompts = [runner.chat(f"Tell me about {topic}.") for topic in topics]
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = runner.tokens(prompts, params)
    engine = runner.engine(**TREE, speculative_disable_batch_size=8)
    assert [o.outputs[0].token_ids for o in runner.run(engine, prompts, params)] == expected
    assert engine.scheduler.stats.num_verify_steps > 0


def test_seeded_sampling_equals_plain_decoding_across_preemption(runner):
    prompts = [runner.chat(f"Tell me about {topic}.") for topic in ("rivers", "owls", "clocks")]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=24)
    expected = runner.tokens(prompts, params)
    memory = 5 * 16 * runner.engine(**TREE).kv_bytes_per_token
    engine = runner.engine(**TREE, kv_cache_memory=memory)
    outputs = runner.run(engine, prompts, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.num_verify_steps > 0
    assert [out.outputs[0].token_ids for out in outputs] == expected
