"""`serve --config` and route settings: a clear error for each mistake, at start."""

from __future__ import annotations

import json

import pytest

from tokenmill.config import EngineArgs
from tokenmill.gateway.registry import specs_from_flags
from tokenmill.gateway.routing import RouteSpec
from tokenmill.gateway.serve_config import read_serve_config

BASE = EngineArgs(kv_cache_memory="64MiB")


def write(tmp_path, data, suffix=".json"):
    path = tmp_path / f"serve{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else data)
    return path


def test_each_model_gets_its_own_engine_flags_over_the_command_lines(tmp_path):
    path = write(
        tmp_path,
        '[[models]]\nname = "small"\nmodel = "smollm2-135m-instruct"\n'
        '[[models]]\nname = "gemma3-270m"\nkv_cache_memory = "32MiB"\n',
        ".toml",
    )
    config = read_serve_config(path, BASE)
    assert [(m.name, m.args.model) for m in config.models] == [
        ("small", "smollm2-135m-instruct"),
        ("gemma3-270m", "gemma3-270m"),
    ]
    assert [m.args.kv_cache_memory for m in config.models] == [64 * 2**20, 32 * 2**20]


def test_the_default_model_comes_first(tmp_path):
    path = write(tmp_path, {"default": "b", "models": [{"name": "a"}, {"name": "b"}]})
    assert [m.name for m in read_serve_config(path, BASE).models] == ["b", "a"]


def test_a_route_naming_an_unknown_model_is_refused(tmp_path):
    data = {"models": ["a", "b"], "routes": {"auto": {"small": "a", "large": "gpt-4o"}}}
    with pytest.raises(ValueError, match="large model 'gpt-4o' is not one of the models"):
        read_serve_config(write(tmp_path, data), BASE)


def test_an_unknown_engine_flag_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown engine flag\(s\) \['kv_cash'\]"):
        read_serve_config(write(tmp_path, {"models": [{"name": "a", "kv_cash": 1}]}), BASE)


def test_two_models_of_one_name_are_refused():
    with pytest.raises(ValueError, match="given twice"):
        specs_from_flags(["gemma3-270m", "gemma3-270m"], BASE)


@pytest.mark.parametrize(("policy", "threshold"), [("random", 1.5), ("classifier", -0.1)])
def test_a_share_or_probability_threshold_outside_0_1_is_refused(policy, threshold):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\]"):
        RouteSpec("auto", policy, "a", "b", threshold, classifier="c.json")


def test_a_cascade_threshold_above_zero_is_refused():
    with pytest.raises(ValueError, match="token logprob, <= 0"):
        RouteSpec("auto", "cascade", "a", "b", 0.5)
