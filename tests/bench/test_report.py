"""Tables line up in a terminal; JSON is strict (no NaN) and takes dataclasses as they are."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest

from tokenmill.bench.report import key_value_table, markdown_table, write_json


@dataclass
class Point:
    x: float


def test_markdown_table_pads_every_column():
    table = markdown_table(["a", "long header"], [["wide cell", "1"]])
    assert table.splitlines() == [
        "| a         | long header |",
        "|-----------|-------------|",
        "| wide cell | 1           |",
    ]


def test_key_value_table_aligns_values():
    assert key_value_table([("a", "1"), ("bbb", "2")]) == "a    1\nbbb  2"


def test_write_json_writes_dataclasses_and_refuses_nan(tmp_path):
    path = tmp_path / "sub" / "out.json"
    write_json(path, {"points": [Point(1.5)], "where": tmp_path})
    assert json.loads(path.read_text()) == {"points": [{"x": 1.5}], "where": str(tmp_path)}
    with pytest.raises(ValueError):
        write_json(path, {"bad": math.nan})
