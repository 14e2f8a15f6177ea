"""The `tokenmill serve` command the benchmarks start: flags that give the engine args back."""

from __future__ import annotations

import pytest

from tokenmill.bench.tokenmill_server import engine_flags
from tokenmill.cli import build_parser, engine_args_from
from tokenmill.config import EngineArgs


def parsed(flags: list[str]) -> EngineArgs:
    return engine_args_from(build_parser().parse_args(["serve", *flags]))


def test_default_engine_args_round_trip_through_the_serve_flags():
    assert parsed(engine_flags(EngineArgs())) == EngineArgs()


def test_every_kind_of_switch_round_trips():
    args = EngineArgs(
        dtype="bfloat16",
        kv_cache_memory="32MiB",
        enable_prefix_caching=False,
        scheduler="dynamic",
        max_wait_ms=12.5,
        max_num_seqs=8,
        max_model_len=512,
        prepack_weights=False,
        speculative_method="ngram",
        speculative_disable_batch_size=2,
    )
    flags = engine_flags(args)
    assert "--no-enable-prefix-caching" in flags and "--max-model-len" in flags
    assert parsed(flags) == args


def test_none_where_the_flag_has_another_default_is_refused():
    with pytest.raises(ValueError, match="speculative_disable_batch_size"):
        engine_flags(EngineArgs(speculative_disable_batch_size=None))
