"""`tokenmill kv-plan`: the KV memory math for Gemma 3 and SmolLM2, trimmed and not."""

from __future__ import annotations

import re

import pytest

from tokenmill.cli import build_parser, engine_args_from, main


def plan_lines(capsys, *args: str) -> str:
    assert main(["kv-plan", *args]) == 0
    return capsys.readouterr().out


def full_length_requests(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"full-length requests held: (\d+)", text)]


def test_gemma_holds_more_full_length_requests_with_window_trimming(capsys):
    text = plan_lines(
        capsys, "--model", "gemma3-270m", "--max-model-len", "8192", "--kv-cache-memory", "1GiB"
    )
    off, on = full_length_requests(text)
    # Off: 18 layers x 2 x 256 x 4 bytes a token; 1GiB holds 3 requests of 8192 tokens. On, a
    # request holds 512 blocks of the full group and 33 in each of the five sliding ones.
    assert off == 2**30 // (18 * 2048 * 8192)
    assert on == (2**30 // (3 * 2048 * 16) - 1) // (512 + 5 * 33)
    assert text.count("window 512") == 5


def test_a_model_without_windows_plans_the_same_either_way(capsys):
    text = plan_lines(capsys, "--model", "smollm2-135m-instruct", "--max-model-len", "2048")
    off, on = full_length_requests(text)
    assert off == on > 0


def test_a_bad_memory_size_is_a_clear_error(capsys):
    assert main(["kv-plan", "--kv-cache-memory", "lots"]) == 2
    assert "kv_cache_memory" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--kv-window-trimming", "--no-kv-window-trimming"])
def test_the_window_trimming_switch_sets_the_engine_field(flag):
    ns = build_parser().parse_args(["generate", "hi", flag])
    assert engine_args_from(ns).kv_window_trimming is (flag == "--kv-window-trimming")
