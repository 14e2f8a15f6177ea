"""The chart writer makes a real PNG without a display."""

from __future__ import annotations

from tokenmill.bench.plots import line_plot


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
