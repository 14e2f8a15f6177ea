"""Training an EAGLE head: the autograd paths equal what drafting computes, and a short run on
the real model writes a head the engine loads and drafts with, greedy output unchanged."""

from __future__ import annotations

import pytest
import torch

from tokenmill.cli import main
from tokenmill.model.attention import AttentionMetadata
from tokenmill.sampling.params import SamplingParams
from tokenmill.spec.eagle import EagleHead, load_head
from tokenmill.spec.medusa import load_medusa_heads
from tokenmill.train.corpus import CONVERSATIONS, FEATURES
from tokenmill.train.eagle import differentiable_forward, two_draft_forward

GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def random_head(smollm):
    torch.manual_seed(0)
    head = EagleHead(smollm.config, draft_vocab_size=16)
    for param in head.parameters():
        param.data.normal_(0, 0.05)
    return head


def test_training_forward_equals_the_inference_forward(smollm, random_head):
    length, hidden = 11, smollm.config.hidden_size
    embeds, features = torch.randn(length, hidden), torch.randn(length, hidden)
    meta = AttentionMetadata.build([length], [length], None, 16, None)
    with torch.no_grad():
        expected = random_head(embeds, features, torch.arange(length), None, meta)
        got = differentiable_forward(random_head, embeds, features)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_second_draft_reads_its_own_prediction_after_the_true_positions(smollm, random_head):
    length, hidden = 9, smollm.config.hidden_size
    embeds, features = torch.randn(length, hidden), torch.randn(length, hidden)
    with torch.no_grad():
        first, second = two_draft_forward(random_head, embeds, features)
        torch.testing.assert_close(first, differentiable_forward(random_head, embeds, features))
        for position in (1, 4, length - 1):
            # Drafting: true features before `position`, the head's prediction at it.
            drafted = torch.cat([features[:position], first[position - 1 : position]])
            alone = differentiable_forward(random_head, embeds[: position + 1], drafted)
            torch.testing.assert_close(second[position - 1], alone[-1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def trained_head(smollm_path, corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("head") / "head.safetensors"
    args = ["train-eagle", "--model", str(smollm_path), "--out", str(out)]
    args += ["--corpus", str(corpus_dir), "--num-prompts", "4", "--max-tokens", "8"]
    args += ["--epochs", "2", "--draft-vocab-size", "64", "--second-draft-weight", "0.5"]
    assert main([*args, "--kv-cache-memory", "32MiB"]) == 0
    return out


def test_train_eagle_writes_a_head_that_loads(smollm, trained_head, corpus_dir):
    head = load_head(trained_head, smollm.config, torch.float32)
    assert len(head.draft_vocab) == 64
    assert set(smollm.tokenizer.stop_token_ids) <= set(head.draft_vocab.tolist())
    assert len((corpus_dir / CONVERSATIONS).read_text().splitlines()) == 4


def test_the_trained_head_drafts_and_leaves_greedy_output_unchanged(runner, trained_head):
    prompts = [runner.chat("Why do cats purr?"), runner.chat("Name three rivers.")]
    expected = runner.tokens(prompts, GREEDY)
    engine = runner.engine(speculative_method="eagle", draft_model=str(trained_head))
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    assert engine.scheduler.stats.num_draft_tokens > 0


def test_train_medusa_reuses_the_corpus_and_features_train_eagle_made(
    smollm, smollm_path, trained_head, corpus_dir, tmp_path
):
    conversations, features = corpus_dir / CONVERSATIONS, corpus_dir / FEATURES
    before = conversations.read_bytes(), features.stat().st_mtime_ns
    out = tmp_path / "heads.safetensors"
    args = ["train-medusa", "--model", str(smollm_path), "--out", str(out)]
    args += ["--corpus", str(corpus_dir), "--num-prompts", "4", "--max-tokens", "8"]
    args += ["--epochs", "1", "--draft-vocab-size", "64", "--kv-cache-memory", "32MiB"]
    assert main(args) == 0
    assert (conversations.read_bytes(), features.stat().st_mtime_ns) == before
    assert len(load_medusa_heads(out, smollm.config, torch.float32).draft_vocab) == 64


def test_training_can_continue_from_a_head_keeping_its_draft_vocabulary(
    smollm, smollm_path, trained_head, corpus_dir, tmp_path
):
    out = tmp_path / "continued.safetensors"
    args = ["train-eagle", "--model", str(smollm_path), "--out", str(out), "--init"]
    args += [str(trained_head), "--corpus", str(corpus_dir), "--num-prompts", "4"]
    args += ["--max-tokens", "8", "--epochs", "1", "--draft-vocab-size", "32"]
    assert main([*args, "--kv-cache-memory", "32MiB"]) == 0
    start = load_head(trained_head, smollm.config, torch.float32)
    continued = load_head(out, smollm.config, torch.float32)
    assert torch.equal(continued.draft_vocab, start.draft_vocab)
    assert not torch.equal(continued.fc.weight, start.fc.weight)
