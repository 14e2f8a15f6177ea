"""PNG charts for the ablation: one chart per technique, series side by side.

matplotlib's object API (Figure, no pyplot) draws without a display or global backend state.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

Series = dict[str, tuple[list[float], list[float]]]
Bars = dict[str, dict[str, float]]


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
    axes.set_xlabel(xlabel)
    axes.grid(alpha=0.3)
    return _save(figure, axes, path, title, ylabel)


def panel_plot(
    path: Path,
    title: str,
    xlabel: str,
    panels: dict[str, Series],
    references: tuple[str, ...] = (),
    log_x: bool = False,
) -> Path:
    """Line charts side by side sharing the x axis: `panels` maps each one's y label to its
    series. A label has one colour in every panel; labels in `references` (a bound such as the
    offered rate) are drawn grey and dashed. `log_x` spaces the x values by ratio (rates that
    double each time) and puts a tick at each."""
    labels = [label for series in panels.values() for label in series if label not in references]
    colours = {label: f"C{index}" for index, label in enumerate(dict.fromkeys(labels))}
    figure = Figure(figsize=(5.0 * len(panels), 4.2), dpi=110)
    grid = figure.subplots(1, len(panels), squeeze=False)[0]
    for axes, (ylabel, series) in zip(grid, panels.items(), strict=True):
        for label, (xs, ys) in series.items():
            reference = label in references
            style = {"color": "grey", "linestyle": "--"} if reference else {"color": colours[label]}
            axes.plot(xs, ys, label=label, marker="o", markersize=3, **style)
        if log_x:
            axes.set_xscale("log", base=2)
            axes.set_xticks(sorted({x for xs, _ in series.values() for x in xs}))
            axes.xaxis.set_major_formatter("{x:g}")
            axes.xaxis.set_minor_formatter("")
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path


def bar_plot(path: Path, title: str, ylabel: str, groups: Bars) -> Path:
    """`groups` maps a group's label on the x axis to {legend label: bar height}; every group
    has the same legend labels, drawn side by side in that order."""
    labels = list(next(iter(groups.values())))
    width = 0.8 / len(labels)
    figure = Figure(figsize=(7.0, 4.2), dpi=110)
    axes = figure.subplots()
    for index, label in enumerate(labels):
        offset = (index - (len(labels) - 1) / 2) * width
        heights = [bars[label] for bars in groups.values()]
        axes.bar([g + offset for g in range(len(groups))], heights, width, label=label)
    axes.set_xticks(range(len(groups)), list(groups))
    tallest = max(height for bars in groups.values() for height in bars.values())
    axes.set_ylim(top=1.4 * tallest or 1.0)  # headroom for the legend
    axes.grid(alpha=0.3, axis="y")
    return _save(figure, axes, path, title, ylabel)


def _save(figure: Figure, axes: Axes, path: Path, title: str, ylabel: str) -> Path:
    axes.set_title(title)
    axes.set_ylabel(ylabel)
    axes.set_ylim(bottom=0)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    return path
