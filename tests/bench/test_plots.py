"""The chart writer makes a real PNG without a display."""

from __future__ import annotations

from tokenmill.bench.plots import line_plot, panel_plot


def test_line_plot_writes_a_png(tmp_path):
    path = line_plot(
        tmp_path / "plots" / "chart.png",
        "title",
        "x",
        "y",
        {"a": ([1.0, 2.0, 3.0], [1.0, 4.0, 9.0]), "b": ([0.0, 5.0], [2.0, 2.0])},
        steps=True,
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_panel_plot_writes_one_png_with_a_panel_per_y_label(tmp_path):
    rates = [0.5, 1.0, 2.0, 4.0]
    path = panel_plot(
        tmp_path / "panels.png",
        "title",
        "rate",
        {
            "goodput": {
                "offered": (rates, rates),
                "a": (rates, [0.5, 1.0, 1.5, 1.0]),
                "b": (rates, [0.5, 1.0, 2.0, 3.5]),
            },
            "p99 TTFT": {"a": (rates, [0.2, 1.0, 4.0, 9.0]), "b": (rates, [0.2, 0.3, 0.5, 1.2])},
        },
        references=("offered",),
        log_x=True,
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
