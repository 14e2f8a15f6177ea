"""The manager's token masks: one row per position, drafts accepted only tentatively, the same
whether the bitmask is filled in the background or in the step loop."""

from __future__ import annotations

import pytest
import torch

from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.structured_outputs import StructuredOutputsParams
from tokenmill.scheduler_output import ScheduledRequest
from tokenmill.structured.manager import StructuredOutputManager

SPEC = StructuredOutputsParams(regex="ab")


@pytest.fixture(scope="module", params=[True, False], ids=["background-fill", "in-loop-fill"])
def manager(smollm, request):
    manager = StructuredOutputManager(smollm.tokenizer, smollm.config.vocab_size, request.param)
    yield manager
    manager.shutdown()


@pytest.fixture
def ids(smollm):
    return {text: smollm.tokenizer.token_to_id(text) for text in ("a", "b", "x", "<|im_end|>")}


def started(manager, request_id="r") -> Request:
    request = Request(request_id, [1, 2, 3], SamplingParams(structured_outputs=SPEC))
    manager.start(request, manager.compile(SPEC).result(timeout=60))
    return request


def allowed(logits: torch.Tensor, row: int, ids: dict[str, int]) -> set[str]:
    return {text for text, token in ids.items() if logits[row, token].isfinite()}


def test_each_draft_row_is_masked_after_the_drafts_before_it(manager, ids, smollm):
    request = started(manager)
    item = ScheduledRequest(request, 2, 0, [0], spec_token_ids=(ids["a"],))
    logits = torch.zeros(2, smollm.config.vocab_size)
    manager.mask_logits([item], logits)
    assert allowed(logits, 0, ids) == {"a"}
    assert allowed(logits, 1, ids) == {"b"}


def test_drafts_do_not_advance_the_matcher(manager, ids, smollm):
    request = started(manager)
    drafted = ScheduledRequest(request, 2, 0, [0], spec_token_ids=(ids["a"],))
    manager.mask_logits([drafted], torch.zeros(2, smollm.config.vocab_size))
    logits = torch.zeros(1, smollm.config.vocab_size)
    manager.mask_logits([ScheduledRequest(request, 1, 0, [0])], logits)
    assert allowed(logits, 0, ids) == {"a"}


def test_rows_after_a_refused_draft_stay_unmasked(manager, ids, smollm):
    request = started(manager)
    item = ScheduledRequest(request, 2, 0, [0], spec_token_ids=(ids["x"],))
    logits = torch.zeros(2, smollm.config.vocab_size)
    manager.mask_logits([item], logits)
    assert allowed(logits, 0, ids) == {"a"}
    assert bool(logits[1].isfinite().all())


def test_unconstrained_rows_are_left_alone(manager, smollm):
    started(manager)
    other = Request("free", [1, 2, 3], SamplingParams())
    logits = torch.zeros(1, smollm.config.vocab_size)
    manager.mask_logits([ScheduledRequest(other, 1, 0, [0])], logits)
    assert bool(logits.isfinite().all())


def test_the_grammar_ends_with_its_stop_token(manager, ids):
    request = started(manager)
    for text in ("a", "b"):
        request.append_token(ids[text])
    assert manager.accept([request]) == []
    request.append_token(ids["<|im_end|>"])
    assert manager.accept([request]) == [request]


def test_requests_with_different_numbers_of_drafts_get_their_own_rows(manager, ids, smollm):
    drafted, plain = started(manager, "drafted"), started(manager, "plain")
    items = [
        ScheduledRequest(drafted, 3, 0, [0], spec_token_ids=(ids["a"], ids["b"])),
        ScheduledRequest(plain, 1, 0, [0]),
    ]
    logits = torch.zeros(4, smollm.config.vocab_size)
    manager.mask_logits(items, logits)
    rows = [allowed(logits, row, ids) for row in range(4)]
    assert rows == [{"a"}, {"b"}, {"<|im_end|>"}, {"a"}]


def test_a_fill_never_applied_is_undone_before_the_matcher_advances(manager, ids, smollm):
    """A step that fails after starting its masks must not leave drafts accepted."""
    request = started(manager)
    manager.start_masks([ScheduledRequest(request, 2, 0, [0], spec_token_ids=(ids["a"],))])
    request.append_token(ids["a"])
    assert manager.accept([request]) == []
    logits = torch.zeros(1, smollm.config.vocab_size)
    manager.mask_logits([ScheduledRequest(request, 1, 0, [0])], logits)
    assert allowed(logits, 0, ids) == {"b"}
