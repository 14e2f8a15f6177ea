"""EAGLE drafting in the engine, as a chain: the shipped head leaves greedy output unchanged and
drafts well enough to matter; a head that does not fit is refused clearly."""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.kernels import ops
from tokenmill.quant.int8 import Int8Linear
from tokenmill.sampling.params import SamplingParams
from tokenmill.spec.eagle import PACKAGED_HEADS, EagleHead, draft_scorer, load_head, save_head
from tokenmill.spec.setup import eagle_head_path

GREEDY = SamplingParams(temperature=0, max_tokens=32)
SHIPPED = PACKAGED_HEADS["smollm2-135m-instruct"]
CHAIN = {"speculative_method": "eagle", "speculative_tree": False}  # trees: test_eagle_tree.py


def test_the_default_model_finds_its_shipped_head(smollm_path):
    assert eagle_head_path(EngineArgs(speculative_method="eagle")) == SHIPPED
    assert (
        eagle_head_path(EngineArgs(model=str(smollm_path), speculative_method="eagle")) == SHIPPED
    )
    assert SHIPPED.stat().st_size <= 30 * 2**20


def test_a_model_without_a_shipped_head_needs_one_named(tmp_path):
    args = EngineArgs(model=str(tmp_path), speculative_method="eagle")
    with pytest.raises(ValueError, match="train-eagle"):
        eagle_head_path(args)


def test_greedy_tokens_equal_plain_decoding_and_drafts_are_accepted(runner):
    prompts = [
        runner.chat("Explain how a refrigerator keeps food cold."),
        runner.chat("Write a haiku about autumn."),
        "The quick brown fox",
    ]
    expected = runner.tokens(prompts, GREEDY)
    engine = runner.engine(**CHAIN)
    outputs = runner.run(engine, prompts, GREEDY)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    stats = engine.scheduler.stats
    assert stats.num_accepted_tokens > 0.15 * stats.num_draft_tokens


@pytest.mark.skipif(ops.backend() != "native", reason="needs the native kernels")
def test_the_head_drafts_the_same_through_the_native_loop_as_in_python(runner):
    prompts = [runner.chat("Explain how a refrigerator keeps food cold.")]
    counts = []
    for native in (True, False):
        engine = runner.engine(**CHAIN)
        proposer = engine.runner.proposer
        assert proposer.native is not None
        if not native:
            proposer.native = None
        runner.run(engine, prompts, GREEDY)
        stats = engine.scheduler.stats
        counts.append((stats.num_draft_tokens, stats.num_accepted_tokens))
    assert counts[0] == counts[1]


def test_draft_rows_are_int8_only_where_the_native_kernel_reads_them(monkeypatch):
    rows, features = torch.randn(96, 64), torch.randn(3, 64)
    exact = features @ rows.T
    with torch.inference_mode():
        if ops.backend() == "native":
            scorer = draft_scorer(rows, torch.float32)
            assert isinstance(scorer, Int8Linear)
            # Each weight rounds by at most half its row's int8 step.
            bound = features.abs().sum(1, keepdim=True) * rows.abs().amax(1) / 254
            assert ((scorer(features) - exact).abs() <= bound + 1e-3).all()
        half = draft_scorer(rows, torch.bfloat16)
        assert not isinstance(half, Int8Linear) and half.weight.dtype == torch.bfloat16
        torch.testing.assert_close(half(features.bfloat16()), exact.bfloat16(), rtol=0.02, atol=0.5)
        monkeypatch.setattr(ops, "_NATIVE", None)
        plain = draft_scorer(rows, torch.float32)
        assert not isinstance(plain, Int8Linear)
        torch.testing.assert_close(plain(features), exact)


def test_seeded_sampling_with_eagle_equals_plain_decoding_across_preemption(runner):
    prompts = [runner.chat(f"Tell me about {topic}.") for topic in ("rivers", "owls", "clocks")]
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=24)
    expected = runner.tokens(prompts, params)
    memory = 5 * 16 * runner.engine(**CHAIN).kv_bytes_per_token
    engine = runner.engine(**CHAIN, kv_cache_memory=memory)
    outputs = runner.run(engine, prompts, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert [out.outputs[0].token_ids for out in outputs] == expected


def test_a_head_for_another_shape_is_refused(smollm, tmp_path):
    other = dict(smollm.config.__dict__, hidden_size=64, intermediate_size=128, head_dim=16)
    config = type(smollm.config)(**other)
    path = tmp_path / "small.safetensors"
    save_head(EagleHead(config, draft_vocab_size=8), path, "other")
    with pytest.raises(ValueError, match="does not fit"):
        load_head(path, smollm.config, torch.float32)
