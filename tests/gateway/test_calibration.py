"""The routing set's grading and the calibration curves' arithmetic."""

from __future__ import annotations

import pytest

from tokenmill.gateway.calibration import (
    cascade_curve,
    random_curve,
    relative_cost,
    share_to_reach,
    summary,
)
from tokenmill.gateway.router_data import Item, routing_items


def record(small: bool, large: bool, conf: float) -> dict:
    return {
        "small_correct": small,
        "large_correct": large,
        "small_mean_logprob": conf,
        "small_min_logprob": conf,
    }


RECORDS = [record(True, True, -0.1), record(False, True, -2.0), record(True, False, -0.5)]


def test_arithmetic_is_graded_on_the_first_number_after_the_last_equals_sign():
    item = Item("arithmetic", "What is 12 + 7?", ("19",))
    assert item.grade(" 19")
    assert item.grade("The answer is 19.")
    assert item.grade("12 + 7 = 19")
    assert not item.grade("18, or 19")


def test_sentiment_is_graded_on_the_first_label_named():
    item = Item("sentiment", "...", ("negative",))
    assert item.grade("Negative.")
    assert not item.grade("positive, not negative")


def test_every_question_is_asked_after_examples_of_its_kind():
    item = Item("factual", "Who wrote Emma?", ("Austen",))
    assert item.prompt.startswith("Q: What is the capital of Poland?\nA: Warsaw\n")
    assert item.prompt.endswith("Q: Who wrote Emma?\nA:")


def test_the_routing_set_is_the_same_on_every_call():
    assert routing_items() == routing_items()
    assert {item.kind for item in routing_items()} == {"arithmetic", "factual", "sentiment"}


def test_a_cascade_spans_all_small_to_all_large():
    curve = cascade_curve(RECORDS, "mean")
    assert (curve[0]["large_share"], curve[0]["accuracy"]) == (0.0, pytest.approx(2 / 3))
    assert (curve[-1]["large_share"], curve[-1]["accuracy"]) == (1.0, pytest.approx(2 / 3))


def test_a_cascade_escalating_only_the_unsure_answer_beats_both_models():
    best = max(cascade_curve(RECORDS, "mean"), key=lambda row: row["accuracy"])
    assert best["accuracy"] == 1.0
    assert best["large_share"] == pytest.approx(1 / 3)
    assert share_to_reach(cascade_curve(RECORDS, "mean"), 1.0) == pytest.approx(1 / 3)


def test_random_routing_interpolates_the_two_accuracies():
    records = [record(True, True, -1), record(False, True, -1)]
    curve = random_curve(records, steps=4)
    assert [row["accuracy"] for row in curve] == pytest.approx([0.5, 0.625, 0.75, 0.875, 1.0])


def priced(small_cost_s: float, large_cost_s: float) -> list[dict]:
    return [
        {**r, "question": f"q{i}", "small_cost_s": small_cost_s, "large_cost_s": large_cost_s}
        for i, r in enumerate(RECORDS)
    ]


def test_a_cascade_pays_for_the_small_model_on_every_prompt():
    assert relative_cost("cascade-mean", 1 / 3, 0.25) == pytest.approx(0.25 + 1 / 3)
    assert relative_cost("classifier", 1 / 3, 0.25) == pytest.approx(2 / 3 * 0.25 + 1 / 3)


def test_compute_saved_prices_the_share_that_reaches_the_large_models_accuracy():
    cascade = summary(priced(1.0, 4.0))["policies"]["cascade-mean"]
    # reaching the large model's 2/3 takes no large call: the small model alone, at 1/4 the cost
    assert cascade["share_at_large"] == 0.0
    assert cascade["compute_saved_at_large"] == pytest.approx(0.75)


def test_records_without_costs_save_calls_but_price_nothing():
    result = summary([{**r, "question": f"q{i}"} for i, r in enumerate(RECORDS)])
    assert result["small_over_large_cost"] is None
    assert result["policies"]["cascade-mean"]["compute_saved_at_large"] is None
