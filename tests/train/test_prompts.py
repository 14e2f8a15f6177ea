"""The shipped training prompts: thousands, varied, reproducible, never a benchmark's own."""

from __future__ import annotations

import pytest

from tokenmill.bench.workloads import chat, chat8, rewrite, rewrite8
from tokenmill.train.prompts import PASSAGES, chat_prompts, num_chat_prompts


def _user_message(chatml_prompt: str) -> str:
    return chatml_prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


def test_the_set_holds_thousands_of_distinct_prompts():
    prompts = chat_prompts(num_chat_prompts())
    assert len(prompts) >= 3000
    assert len(set(prompts)) == len(prompts)


def test_no_benchmark_workload_prompt_is_in_the_set():
    workloads = [*chat(), *chat8(), *rewrite(), *rewrite8()]
    bench = {_user_message(request.prompt) for request in workloads}
    assert len(bench) == 16
    prompts = set(chat_prompts(num_chat_prompts()))
    assert not bench & prompts
    # Nor any prompt that holds one of them, such as a rewrite of the bench passage.
    assert not [p for p in prompts if any(b in p or p in b for b in bench)]


def test_prompts_are_reproducible_and_a_larger_count_extends_a_smaller():
    assert chat_prompts(200, seed=1) == chat_prompts(200, seed=1)
    assert chat_prompts(500, seed=1)[:200] == chat_prompts(200, seed=1)
    assert chat_prompts(200, seed=1) != chat_prompts(200, seed=2)


def test_a_sample_mixes_kinds_of_request():
    sample = chat_prompts(1000)
    kinds = {
        "explanation": lambda p: p.startswith(("Explain", "Can you walk me")),
        "story or poem": lambda p: "story" in p or "poem" in p or "haiku" in p,
        "list": lambda p: p.startswith(("List", "Make a short checklist", "Give me some tips")),
        "comparison": lambda p: p.startswith(("Compare", "What is the difference")),
        "advice": lambda p: p.startswith(("How do I", "How can I", "How should I")),
        "given text": lambda p: any(text in p for text in PASSAGES),
    }
    for kind, matches in kinds.items():
        assert sum(map(matches, sample)) >= 10, kind


def test_asking_for_more_prompts_than_the_set_holds_is_refused():
    with pytest.raises(ValueError, match="count"):
        chat_prompts(num_chat_prompts() + 1)
