"""The workloads: the same token ids on every engine, exactly as the engine issue defines."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.workloads import (
    RequestShape,
    batch64,
    load_workload,
    long_prompts,
    mixed_requests,
    random_requests,
    sessions,
    single,
    tenants,
)


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


SHORT = RequestShape(prompt_len=(4, 8), max_tokens=(1, 3))
LONG = RequestShape(prompt_len=(100, 120), max_tokens=(20, 30))


def test_mixed_requests_are_the_same_for_the_same_seed_and_differ_for_another():
    first = mixed_requests(7, 50, SHORT, LONG, long_share=0.3)
    assert first == mixed_requests(7, 50, SHORT, LONG, long_share=0.3)
    assert first != mixed_requests(8, 50, SHORT, LONG, long_share=0.3)


def test_mixed_requests_draw_each_request_from_one_shape():
    requests = mixed_requests(3, 400, SHORT, LONG, long_share=0.25)
    long = [r for r in requests if len(r.prompt_token_ids or []) >= 100]
    short = [r for r in requests if len(r.prompt_token_ids or []) <= 8]
    assert len(long) + len(short) == len(requests)
    assert all(20 <= r.max_tokens <= 30 for r in long)
    assert all(1 <= r.max_tokens <= 3 for r in short)
    assert 0.18 < len(long) / len(requests) < 0.32


def test_mixed_requests_at_the_ends_of_the_share_are_all_one_shape():
    assert all(r.max_tokens <= 3 for r in mixed_requests(1, 20, SHORT, LONG, long_share=0))
    assert all(r.max_tokens >= 20 for r in mixed_requests(1, 20, SHORT, LONG, long_share=1))
    with pytest.raises(ValueError, match="long_share"):
        mixed_requests(1, 20, SHORT, LONG, long_share=1.5)


def test_sessions_share_a_system_prompt_and_grow_each_history_turn_by_turn():
    requests = sessions(num_sessions=3, turns=2, system_tokens=20, user_tokens=5, reply_tokens=4)
    assert len(requests) == 6
    first_turns, second_turns = requests[:3], requests[3:]
    assert all(r.after is None for r in first_turns)
    assert [r.after for r in second_turns] == [0, 1, 2]
    system = first_turns[0].prompt_token_ids[:20]
    assert all(r.prompt_token_ids[:20] == system for r in requests)
    for first, second in zip(first_turns, second_turns, strict=True):
        assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
        assert len(second.prompt_token_ids) == len(first.prompt_token_ids) + 4 + 5


def test_tenants_requests_each_start_with_one_of_the_tenants_system_prompts():
    requests = tenants(num_tenants=3, system_tokens=40, count=30, user_tokens=(5, 9))
    systems = {tuple(r.prompt_token_ids[:40]) for r in requests}
    assert len(requests) == 30 and len(systems) == 3
    assert all(45 <= len(r.prompt_token_ids) <= 49 for r in requests)


def test_eight_stream_workloads_hold_eight_distinct_prompts_led_by_the_single_stream_one():
    for name, single_stream in (("chat8", "chat"), ("rewrite8", "rewrite")):
        requests = load_workload(name)
        assert len({r.prompt for r in requests}) == 8
        assert requests[0] == load_workload(single_stream)[0]


def test_long8_is_eight_distinct_3000_token_prompts():
    requests = long_prompts()
    assert load_workload("long8") == requests
    assert [len(r.prompt_token_ids or []) for r in requests] == [3000] * 8
    assert len({tuple(r.prompt_token_ids or []) for r in requests}) == 8
