"""The parser `main()` builds: every command's engine and sampling flags and what they make."""

from __future__ import annotations

import pytest

from tokenmill.cli import build_parser, engine_args_from
from tokenmill.cli.sampling_args import sampling_params_from
from tokenmill.config import EngineArgs

ENGINE_COMMANDS = (
    ["generate", "hi"],
    ["chat"],
    ["serve"],
    ["bench", "throughput"],
    ["bench", "ablate"],
    ["bench", "anchors"],
    ["bench", "roofline"],
    ["train-corpus", "--corpus", "corpus"],
    ["train-eagle", "--out", "head.safetensors"],
    ["train-medusa", "--out", "heads.safetensors"],
)


@pytest.mark.parametrize("argv", ENGINE_COMMANDS, ids=lambda argv: " ".join(argv[:2]))
def test_unset_engine_flags_give_engine_args_defaults(argv):
    assert engine_args_from(build_parser().parse_args(argv)) == EngineArgs()


def test_an_engine_flag_sets_the_field_of_the_same_name():
    ns = build_parser().parse_args(
        ["generate", "hi", "--kv-cache-dtype", "int8", "--no-enable-prefix-caching"]
    )
    args = engine_args_from(ns)
    assert args.kv_cache_dtype == "int8" and args.enable_prefix_caching is False


def test_sampling_flags_reach_the_sampling_params():
    ns = build_parser().parse_args(
        ["generate", "hi", "--max-tokens", "5", "--temperature", "0", "--top-k", "3", "--seed", "7"]
    )
    params = sampling_params_from(ns)
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (5, 0.0, 3, 7)


def test_every_command_dispatches_to_its_own_handler():
    parser = build_parser()
    handlers = {
        parser.parse_args(argv).func
        for argv in (
            *ENGINE_COMMANDS,
            ["bench", "serve"],
            ["quantize", "--method", "int8", "m", "out"],
            ["eval"],
            ["export-hf", "m", "out"],
        )
    }
    assert len(handlers) == len(ENGINE_COMMANDS) + 4
