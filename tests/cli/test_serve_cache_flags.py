"""`tokenmill serve`'s semantic cache flags: the threshold as a number or a calibration file,
and the SQLite file that keeps the cache across restarts."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import build_parser
from tokenmill.cli.serve import _semantic_cache
from tokenmill.gateway.cache_store import CacheStore
from tokenmill.gateway.semantic_cache import DEFAULT_THRESHOLD


def cache_of(*flags: str):
    return _semantic_cache(build_parser().parse_args(["serve", *flags]))


def test_without_the_flag_there_is_no_cache():
    assert cache_of() is None


def test_a_cache_path_without_the_cache_is_refused():
    with pytest.raises(ValueError, match="--semantic-cache-path needs --semantic-cache"):
        cache_of("--semantic-cache-path", "unused.db")


def test_the_default_threshold_is_the_documented_one():
    assert cache_of("--semantic-cache").settings.threshold == DEFAULT_THRESHOLD


def test_the_threshold_comes_from_the_file_cache_calibrate_wrote(tmp_path):
    path = tmp_path / "threshold.json"
    path.write_text(json.dumps({"threshold": 0.932, "guard": True}))
    assert (
        cache_of("--semantic-cache", "--semantic-cache-threshold", str(path)).settings.threshold
        == 0.932
    )


def test_a_threshold_outside_0_1_is_refused():
    with pytest.raises(ValueError, match="threshold must be in"):
        cache_of("--semantic-cache", "--semantic-cache-threshold", "1.5")


def test_a_cache_path_keeps_the_cache_in_that_file(tmp_path):
    cache = cache_of("--semantic-cache", "--semantic-cache-path", str(tmp_path / "c.db"))
    assert isinstance(cache.store, CacheStore)
    assert (tmp_path / "c.db").is_file()
