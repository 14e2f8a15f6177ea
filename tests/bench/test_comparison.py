"""Each ablation row names its winner and the margin, the way a reader would say it."""

from __future__ import annotations

from tokenmill.bench.comparison import Comparison, comparison_table


def row(base: float, cand: float, higher_is_better: bool, unit: str = "s") -> Comparison:
    return Comparison("t", "m", unit, "off", base, "on", cand, higher_is_better)


def test_lower_time_wins_by_the_ratio():
    verdict = row(8.0, 2.0, higher_is_better=False)
    assert (verdict.winner, verdict.margin) == ("on", "4.00x lower")


def test_higher_throughput_wins_and_the_baseline_can_win():
    verdict = row(120.0, 100.0, higher_is_better=True, unit="tok/s")
    assert (verdict.winner, verdict.margin) == ("off", "1.20x higher")


def test_values_within_two_percent_are_a_tie():
    assert row(100.0, 101.0, higher_is_better=False).winner == "tie"
    assert row(0.0, 0.0, higher_is_better=True).winner == "tie"


def test_a_win_against_zero_names_no_ratio():
    verdict = row(0.0, 2.0, higher_is_better=True, unit="req/s")
    assert (verdict.winner, verdict.margin) == ("on", "higher, against 0")


def test_fractions_compare_in_percentage_points():
    verdict = row(0.62, 0.05, higher_is_better=False, unit="%")
    assert (verdict.winner, verdict.margin) == ("on", "57.0 points lower")
    assert verdict.cells()[2:4] == ["off: 62.0%", "on: 5.0%"]


def test_table_has_one_line_per_row_under_a_header():
    lines = comparison_table([row(2, 1, False), row(1, 2, True)]).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| technique")
    assert len({len(line) for line in lines}) == 1  # columns line up
