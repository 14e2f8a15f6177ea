"""`tokenmill eval`'s driver: quality against the unquantized model, bytes, speed, one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.evaluate import evaluate
from tokenmill.loader.quantized_checkpoint import save_quantized
from tokenmill.quant.registry import quant_method


def test_one_table_for_methods_and_checkpoints(
    smollm_path: Path, quantized_smollm, tmp_path: Path
) -> None:
    checkpoint = save_quantized(quantized_smollm("int4"), quant_method("int4"), tmp_path / "int4")
    workload = tmp_path / "tiny.jsonl"
    workload.write_text(json.dumps({"prompt": "The capital of France is", "max_tokens": 4}) + "\n")
    report = evaluate(
        str(smollm_path),
        ["int8"],
        [str(checkpoint)],
        eval_samples=2,
        eval_seq_len=32,
        speed_workloads=(str(workload),),
    )
    assert [row.name for row in report.rows] == ["none", "int8", str(checkpoint)]
    baseline, int8, saved = report.rows
    assert baseline.quality.kl_divergence == 0.0
    assert saved.weight_bytes < int8.weight_bytes < baseline.weight_bytes
    assert baseline.kv_bytes_per_token == int8.kv_bytes_per_token > 0
    assert all(row.tokens_per_s[str(workload)] > 0 for row in report.rows)
    table = report.table()
    assert "int8" in table and "KL" in table and str(checkpoint) in table
    report.write_json(tmp_path / "eval.json")
    saved_json = json.loads((tmp_path / "eval.json").read_text())
    assert saved_json["rows"][1]["quality"]["kl_divergence"] == int8.quality.kl_divergence


def test_too_many_windows_is_a_clear_error(smollm_path: Path) -> None:
    with pytest.raises(ValueError, match="num_samples=5000"):
        evaluate(str(smollm_path), [], [], eval_samples=5000, eval_seq_len=256)
