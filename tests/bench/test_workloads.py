"""The workloads: the same token ids on every engine, exactly as the engine issue defines."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.workloads import batch64, load_workload, random_requests, single


def test_batch64_has_the_published_token_counts():
    requests = batch64()
    assert len(requests) == 64
    assert sum(len(r.prompt_token_ids or []) for r in requests) == 10_071
    assert sum(r.max_tokens for r in requests) == 9_169


def test_single_is_one_32_token_prompt_for_128_tokens():
    (request,) = single()
    assert len(request.prompt_token_ids or []) == 32 and request.max_tokens == 128


def test_random_requests_with_batch64_sizes_is_batch64():
    assert random_requests(1, 64, (32, 256), (32, 256)) == batch64()


def test_jsonl_workload_takes_text_or_token_ids(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"prompt": "Hello", "max_tokens": 3}, {"prompt_token_ids": [1, 2], "max_tokens": 4}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    text, ids = load_workload(str(path))
    assert text.prompt_input == "Hello" and ids.prompt_input == [1, 2]
    assert (text.max_tokens, ids.max_tokens) == (3, 4)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "x"}', "max_tokens"),
        ('{"prompt": "x", "prompt_token_ids": [1], "max_tokens": 2}', "exactly one"),
        ("not json", "w.jsonl:1"),
    ],
)
def test_bad_jsonl_line_is_a_value_error_naming_the_line(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_workload(str(path))


def test_unknown_workload_name_lists_the_choices():
    with pytest.raises(ValueError, match="batch64, single"):
        load_workload("batch65")
