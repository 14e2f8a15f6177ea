"""One measured metric with a technique off and on, and a verdict: which side wins, by how much."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.bench.report import markdown_table

TIE_WITHIN = 0.02  # closer than 2% is within run-to-run noise on a shared machine


@dataclass
class Comparison:
    technique: str
    metric: str
    unit: str  # "%" means the values are fractions, compared in percentage points
    baseline: str
    baseline_value: float
    candidate: str
    candidate_value: float
    higher_is_better: bool
    winner: str = field(init=False)
    margin: str = field(init=False)

    def __post_init__(self) -> None:
        self.winner, self.margin = self._verdict()

    def _verdict(self) -> tuple[str, str]:
        base, cand = self.baseline_value, self.candidate_value
        candidate_better = cand > base if self.higher_is_better else cand < base
        better_name = self.candidate if candidate_better else self.baseline
        direction = "higher" if self.higher_is_better else "lower"
        if self.unit == "%":
            points = abs(cand - base) * 100
            if points < TIE_WITHIN * 100:
                return "tie", f"{points:.1f} points apart"
            return better_name, f"{points:.1f} points {direction}"
        low, high = sorted((abs(base), abs(cand)))
        if high == 0 or (high - low) / high < TIE_WITHIN:
            return "tie", "within 2%"
        if low == 0:  # no ratio to a zero, e.g. a rate no request was served within
            return better_name, f"{direction}, against 0"
        return better_name, f"{high / low:.2f}x {direction}"

    def cells(self) -> list[str]:
        return [
            self.technique,
            self.metric,
            f"{self.baseline}: {format_value(self.baseline_value, self.unit)}",
            f"{self.candidate}: {format_value(self.candidate_value, self.unit)}",
            self.winner,
            self.margin,
        ]


def format_value(value: float, unit: str) -> str:
    if unit == "%":
        return f"{value * 100:.1f}%"
    magnitude = abs(value)
    digits = 0 if magnitude >= 100 or float(value).is_integer() else 1 if magnitude >= 10 else 2
    return f"{value:,.{digits}f}{'' if unit == 'x' else ' '}{unit}"


def comparison_table(rows: list[Comparison]) -> str:
    headers = ["technique", "metric", "baseline", "technique on", "winner", "by"]
    return markdown_table(headers, [row.cells() for row in rows])
