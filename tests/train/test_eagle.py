"""Training an EAGLE head: the autograd path equals the inference path, and a short run on the
real model writes a head the engine loads."""

from __future__ import annotations

import torch

from tokenmill.cli import main
from tokenmill.model.attention import AttentionMetadata
from tokenmill.spec.eagle import EagleHead, load_head
from tokenmill.train.eagle import (
    TEMPLATES,
    TOPICS,
    answer_temperature,
    differentiable_forward,
    training_prompts,
)


def test_training_forward_equals_the_inference_forward(smollm):
    torch.manual_seed(0)
    head = EagleHead(smollm.config, draft_vocab_size=16)
    for param in head.parameters():
        param.data.normal_(0, 0.05)
    length, hidden = 11, smollm.config.hidden_size
    embeds, features = torch.randn(length, hidden), torch.randn(length, hidden)
    meta = AttentionMetadata.build([length], [length], None, 16, None)
    with torch.no_grad():
        expected = head(embeds, features, torch.arange(length), None, meta)
        got = differentiable_forward(head, embeds, features)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_training_prompts_are_distinct_and_reproducible():
    prompts = training_prompts(100, seed=3)
    assert len(set(prompts)) == 100
    assert prompts == training_prompts(100, seed=3)


def test_repeated_training_prompts_are_answered_by_sampling():
    distinct = len(TOPICS) * len(TEMPLATES)
    prompts = training_prompts(2 * distinct, seed=0)
    assert prompts[distinct:] == prompts[:distinct]
    greedy = [i for i in range(2 * distinct) if answer_temperature(i) == 0.0]
    assert len(greedy) == distinct // 2
    assert len({prompts[i] for i in greedy}) == len(greedy)


def test_train_eagle_command_writes_a_head_that_loads(smollm, smollm_path, tmp_path, capsys):
    out = tmp_path / "head.safetensors"
    code = main(
        [
            "train-eagle",
            "--model",
            str(smollm_path),
            "--out",
            str(out),
            "--num-prompts",
            "4",
            "--max-tokens",
            "8",
            "--epochs",
            "1",
            "--draft-vocab-size",
            "64",
            "--kv-cache-memory",
            "32MiB",
        ]
    )
    assert code == 0
    assert "held-out first-draft accuracy" in capsys.readouterr().err
    head = load_head(out, smollm.config, torch.float32)
    assert len(head.draft_vocab) == 64
    assert set(smollm.tokenizer.stop_token_ids) <= set(head.draft_vocab.tolist())
