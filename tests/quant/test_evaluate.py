"""`tokenmill eval`: quality against the unquantized model, bytes, speed, one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tokenmill import cli
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.calibration import token_windows
from tokenmill.quant.checkpoint import save_quantized
from tokenmill.quant.evaluate import evaluate, measure_quality, model_weight_bytes
from tokenmill.quant.registry import quant_method


@pytest.fixture(scope="module")
def windows(smollm) -> torch.Tensor:
    return token_windows(smollm.tokenizer, "heldout", 3, 40)


def test_a_model_against_itself_diverges_nowhere(smollm, windows):
    quality = measure_quality(smollm.model, smollm.model, windows)
    assert quality.kl_divergence == 0.0 and quality.top1_agreement == 1.0


def test_perplexity_is_the_exponent_of_the_mean_next_token_loss(smollm, windows):
    losses = []
    for window in windows.tolist():
        meta = AttentionMetadata.build([len(window)], [len(window)], None, 16, None)
        with torch.inference_mode():
            hidden = smollm.model(torch.tensor(window), torch.arange(len(window)), None, meta)
            logits = smollm.model.compute_logits(hidden)
        losses.append(F.cross_entropy(logits[:-1], torch.tensor(window[1:]), reduction="none"))
    expected = torch.cat(losses).mean().exp().item()
    quality = measure_quality(smollm.model, smollm.model, windows)
    assert quality.perplexity == pytest.approx(expected, rel=1e-4)


def test_quantized_rows_compare_against_the_baseline(smollm, quantized_smollm, windows):
    int8 = measure_quality(smollm.model, quantized_smollm("int8").model, windows)
    assert 0.0 < int8.kl_divergence < 0.02 and int8.top1_agreement > 0.9
    assert model_weight_bytes(quantized_smollm("int8").model) < model_weight_bytes(smollm.model)


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


def test_cli_writes_the_table_and_json(smollm_path: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "eval.json"
    argv = ["eval", "--model", str(smollm_path), "--quantization", "fp8"]
    argv += ["--eval-samples", "2", "--eval-seq-len", "24", "--no-speed", "--json", str(out)]
    assert cli.main(argv) == 0
    assert "fp8" in capsys.readouterr().out
    assert [row["name"] for row in json.loads(out.read_text())["rows"]] == ["none", "fp8"]


def test_too_many_windows_is_a_clear_error(smollm_path: Path) -> None:
    with pytest.raises(ValueError, match="num_samples=5000"):
        evaluate(str(smollm_path), [], [], eval_samples=5000, eval_seq_len=256)


def test_cli_kv_cache_dtypes_alone_give_baseline_and_kv_rows(
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
