"""`tokenmill eval` as a command: the table on stdout and the report as JSON."""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill import cli


def test_eval_prints_the_table_and_writes_the_json(
    smollm_path: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(smollm_path), "--quantization", "fp8"]
    argv += ["--eval-samples", "2", "--eval-seq-len", "24", "--no-speed", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "fp8" in capsys.readouterr().out
    assert [row["name"] for row in json.loads(out.read_text())["rows"]] == ["none", "fp8"]


def test_kv_cache_dtypes_alone_give_the_baseline_and_kv_rows(
    smollm_path: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(smollm_path), "--kv-cache-dtype", "int8", "fp8"]
    argv += ["--eval-samples", "2", "--eval-seq-len", "24", "--no-speed", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "kv-cache int8" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [row["name"] for row in rows] == ["none", "kv-cache int8", "kv-cache fp8"]
    baseline, int8, fp8 = rows
    assert int8["weight_bytes"] == baseline["weight_bytes"]
    assert int8["kv_bytes_per_token"] == fp8["kv_bytes_per_token"] < baseline["kv_bytes_per_token"]
    assert 0 < int8["quality"]["kl_divergence"] < fp8["quality"]["kl_divergence"]
