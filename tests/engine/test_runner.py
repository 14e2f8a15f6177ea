"""ModelRunner without a model: copy-on-write block copies reach every paged KV tensor, and a
verify step samples each position as plain decoding would."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from tokenmill.engine.runner import ModelRunner, RunnerOutput
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler_output import ScheduledRequest, SchedulerOutput

VOCAB = 16
EOS = 0


def paged_cache(seed: int) -> torch.Tensor:
    """[K/V, blocks, block_size, kv_heads, head_dim]"""
    return torch.randn(2, 6, 4, 2, 3, generator=torch.Generator().manual_seed(seed))


def test_block_copies_copy_k_and_v_in_every_layer_and_the_drafters_cache():
    layers, drafter = [paged_cache(0), paged_cache(1)], [paged_cache(2)]
    before = [cache.clone() for cache in [*layers, *drafter]]
    proposer = SimpleNamespace(own_kv_caches=drafter)  # a drafter with a paged KV of its own
    runner = ModelRunner(nn.Identity(), layers, block_size=4, proposer=proposer)
    runner.execute(SchedulerOutput(block_copies=[(1, 4), (2, 5)]))
    for cache, old in zip([*layers, *drafter], before, strict=True):
        for kv in (0, 1):  # K, then V
            assert torch.equal(cache[kv, 4], old[kv, 1])
            assert torch.equal(cache[kv, 5], old[kv, 2])
        assert torch.equal(cache[:, :4], old[:, :4])


def test_block_copies_read_every_source_before_writing():
    cache = paged_cache(3)
    old = cache.clone()
    ModelRunner(nn.Identity(), [cache], block_size=4).copy_blocks([(1, 2), (2, 3)])
    assert torch.equal(cache[:, 2], old[:, 1]) and torch.equal(cache[:, 3], old[:, 2])


def verify(
    params: SamplingParams,
    drafts: tuple[int, ...],
    preferences: list[list[tuple[int, float]]],
    parents: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
) -> list[int]:
    """The tokens a verify step emits for one request whose target logits prefer, at the root
    and after each draft, `preferences[row]` ((token, logit) pairs; every other token 0)."""
    request = Request("r", [1, 2, 3], params, eos_token_ids=frozenset({EOS}))
    request.output_token_ids = list(output)
    num_known = len(request.prompt_token_ids) + len(output)
    item = ScheduledRequest(
        request,
        num_new_tokens=1 + len(drafts),
        num_computed_tokens=num_known - 1,
        block_ids=[0],
        spec_token_ids=drafts,
        spec_parents=parents,
    )
    logits = torch.zeros(1 + len(drafts), VOCAB)
    for row, pairs in enumerate(preferences):
        for token, logit in pairs:
            logits[row, token] = logit
    result = RunnerOutput()
    ModelRunner(nn.Identity(), None, block_size=4)._sample([item], logits, result)
    return result.sampled["r"]


def test_a_verified_position_is_penalised_for_the_drafts_before_it():
    """After accepting draft 5, the target's favourite is 5 again; presence_penalty takes it
    off, as it would one token at a time, so 7 is emitted (and draft 6 rejected)."""
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    preferences = [[(5, 10.0)], [(5, 10.0), (7, 9.0)], []]
    assert verify(params, (5, 6), preferences) == [5, 7]
    unpenalised = SamplingParams(temperature=0)
    assert verify(unpenalised, (5, 6), preferences) == [5, 5]


def test_a_tree_position_is_penalised_for_its_own_path_only():
    """Drafts 5 and 6 are siblings; after 6 the target prefers 6, then 5: 5 lies on the other
    branch, so it is not penalised there, and 6 is."""
    params = SamplingParams(temperature=0, presence_penalty=2.0)
    preferences = [[(6, 10.0)], [], [(6, 10.0), (5, 9.0)]]
    assert verify(params, (5, 6), preferences, parents=(-1, -1)) == [6, 5]


def test_min_tokens_counts_the_drafts_before_a_position():
    """One token out and min_tokens 2: end of sequence is masked at the root and allowed after
    an accepted draft, where plain decoding would have two tokens out."""
    params = SamplingParams(temperature=0, min_tokens=2)
    preferences = [[(EOS, 10.0), (5, 9.0)], [(EOS, 10.0), (8, 9.0)], []]
    assert verify(params, (5, 6), preferences, output=(4,)) == [5, EOS]
