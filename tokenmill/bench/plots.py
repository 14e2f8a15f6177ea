"""PNG charts for the ablation: one line chart per technique, series side by side.

matplotlib's object API (Figure, no pyplot) draws without a display or global backend state.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

Series = dict[str, tuple[list[float], list[float]]]


def line_plot(
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    series: Series,
    steps: bool = False,
) -> Path:
    """`series` maps a legend label to (xs, ys); `steps` draws a staircase (counts over time)."""
    figure = Figure(figsize=(7.0, 4.2), dpi=110)
    axes = figure.subplots()
    for label, (xs, ys) in series.items():
        axes.plot(
            xs,
            ys,
            label=label,
            marker="o" if len(xs) <= 32 else None,
            markersize=3,
            drawstyle="steps-post" if steps else "default",
        )
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
