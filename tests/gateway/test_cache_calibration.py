"""The semantic cache's threshold calibrated to a target false-hit rate, and the file that
carries it to `tokenmill serve`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tokenmill.gateway.cache_eval import (
    ScoredPairs,
    calibrate,
    lowest_threshold,
    read_pairs,
    read_threshold,
)
from tokenmill.gateway.embedding import packaged_embedder


def scored(paraphrases: list[float], near_misses: list[float]) -> ScoredPairs:
    similarity = np.array(paraphrases + near_misses)
    n = len(similarity)
    should = np.array([True] * len(paraphrases) + [False] * len(near_misses))
    return ScoredPairs(similarity, np.zeros(n, bool), np.ones(n, bool), should)


def test_a_zero_target_puts_the_threshold_just_above_the_closest_near_miss():
    pairs = scored([0.99, 0.95, 0.90], [0.80, 0.9205, 0.70])
    assert lowest_threshold(pairs, 0.0, guarded=True) == 0.921


def test_a_looser_target_lowers_the_threshold_to_let_one_near_miss_through():
    pairs = scored([0.99, 0.95, 0.90], [0.80, 0.9205, 0.70])
    assert lowest_threshold(pairs, 0.34, guarded=True) == 0.801


def test_near_misses_the_guard_stops_do_not_raise_the_threshold():
    pairs = scored([0.99], [0.98, 0.50])
    pairs.guard[1] = False  # the 0.98 near miss names another number
    assert lowest_threshold(pairs, 0.0, guarded=True) == 0.501
    assert lowest_threshold(pairs, 0.0, guarded=False) == 0.981


def test_a_target_no_threshold_meets_is_a_clear_error():
    with pytest.raises(ValueError, match="no threshold"):
        lowest_threshold(scored([0.99], [1.0]), 0.0, guarded=False)


def test_the_calibrated_threshold_meets_the_target_on_the_packaged_pairs():
    result = calibrate(read_pairs(), packaged_embedder(), 0.05)
    assert result["false_hit_rate"] <= 0.05
    assert 0 <= result["threshold"] <= 1
    assert 0 <= result["held_out_false_hit_rate"] <= 1


def test_serve_reads_the_threshold_from_the_calibration_file(tmp_path):
    path = tmp_path / "threshold.json"
    path.write_text(json.dumps(calibrate(read_pairs(), packaged_embedder(), 0.05)))
    assert read_threshold(str(path)) == json.loads(path.read_text())["threshold"]
    assert read_threshold("0.9") == 0.9


def test_a_threshold_that_is_neither_a_number_nor_a_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--semantic-cache-threshold"):
        read_threshold(str(tmp_path / "missing.json"))
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(ValueError, match="--semantic-cache-threshold"):
        read_threshold(str(tmp_path / "other.json"))
