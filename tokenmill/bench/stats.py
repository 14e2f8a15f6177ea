"""Summary statistics every benchmark reports the same way: mean and percentiles of a sample."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Distribution:
    """Milliseconds or any other unit; the caller's field name carries the unit."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0, 0.0)
        ordered = sorted(values)
        return cls(
            statistics.fmean(ordered),
            percentile(ordered, 50),
            percentile(ordered, 90),
            percentile(ordered, 99),
            ordered[-1],
        )

    def summary(self, unit: str = "ms", with_p90: bool = False) -> str:
        """One line: mean, p50 and p99 (p90 too with `with_p90`) joined by " / ", then the
        unit."""
        values = [self.mean, self.p50, *([self.p90] if with_p90 else []), self.p99]
        return " / ".join(f"{v:.1f}" for v in values) + f" {unit}"


def percentile(ordered: list[float], pct: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method) of sorted values."""
    position = (len(ordered) - 1) * pct / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
