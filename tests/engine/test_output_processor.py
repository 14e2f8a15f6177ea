"""OutputProcessor on the real SmolLM2 tokenizer: text is held back while it may still start a
stop string, a stop string is reported (never applied: the scheduler ends requests), and each
parent's output is assembled once and forgotten when finished."""

from __future__ import annotations

import pytest

from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.request import Request, RequestStatus
from tokenmill.sampling.params import SamplingParams
from tokenmill.sampling.sampler import TokenLogprobs


@pytest.fixture
def tokenizer(smollm):
    return smollm.tokenizer


def tracked(processor: OutputProcessor, tokenizer, **params) -> Request:
    prompt = tokenizer.encode("Say something.", add_special_tokens=False)
    request = Request("r", prompt, SamplingParams(**params))
    processor.add("r", "Say something.", [request])
    return request


def generate(request: Request, tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token in ids:
        request.append_token(token)
    return ids


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer):
    processor = OutputProcessor(tokenizer)
    request = tracked(processor, tokenizer, stop=["STOP"])
    generate(request, tokenizer, "Hello there S")
    assert processor.update_text([request], {}) == []
    (output,) = processor.outputs([request])
    assert output.outputs[0].text == "Hello ther"  # three characters held for "STOP"


def test_a_stop_string_is_reported_with_the_token_that_completed_it(tokenizer):
    processor = OutputProcessor(tokenizer)
    request = tracked(processor, tokenizer, stop=[" world"])
    ids = generate(request, tokenizer, "Hello world and more")
    (hit,) = processor.update_text([request], {})
    kept = tokenizer.decode(ids[: hit.num_output_tokens])
    assert hit.request is request and hit.stop == " world"
    assert kept.endswith(" world") and not tokenizer.decode(
        ids[: hit.num_output_tokens - 1]
    ).endswith(" world")
    assert request.output_token_ids == ids  # reported, not applied
    assert request.status == RequestStatus.WAITING


def test_the_text_ends_before_the_stop_string_unless_asked_to_keep_it(tokenizer):
    for include, expected in ((False, "Hello"), (True, "Hello world")):
        processor = OutputProcessor(tokenizer)
        request = tracked(processor, tokenizer, stop=[" world"], include_stop_str_in_output=include)
        generate(request, tokenizer, "Hello world and more")
        (hit,) = processor.update_text([request], {})
        request.truncate_output(hit.num_output_tokens)
        request.status = RequestStatus.FINISHED
        (output,) = processor.outputs([request])
        assert output.outputs[0].text == expected


def test_logprobs_are_kept_only_up_to_the_stop(tokenizer):
    processor = OutputProcessor(tokenizer)
    request = tracked(processor, tokenizer, stop=[" world"], logprobs=0)
    ids = generate(request, tokenizer, "Hello world and more")
    entries = [TokenLogprobs(token, -0.5, 1, []) for token in ids]
    (hit,) = processor.update_text([request], {"r": entries})
    request.truncate_output(hit.num_output_tokens)
    (output,) = processor.outputs([request])
    assert [entry.token_id for entry in output.outputs[0].logprobs] == ids[: hit.num_output_tokens]
    assert output.outputs[0].cumulative_logprob == pytest.approx(-0.5 * hit.num_output_tokens)


def test_a_finished_parent_is_forgotten_after_its_last_output(tokenizer):
    processor = OutputProcessor(tokenizer)
    request = tracked(processor, tokenizer, max_tokens=4)
    generate(request, tokenizer, "Hi")
    processor.update_text([request], {})
    assert processor.child_ids("r") == ["r"]
    request.status = RequestStatus.FINISHED
    (output,) = processor.outputs([request])
    assert output.finished and output.outputs[0].text == "Hi"
    assert processor.child_ids("r") == []
