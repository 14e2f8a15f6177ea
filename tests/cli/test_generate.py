"""`tokenmill generate`: one prompt's completion streamed to stdout, errors as one line."""

from __future__ import annotations


def test_generate_streams_paris_for_the_capital_of_france(run_cli):
    result = run_cli(
        "generate",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--temperature",
        "0",
        "--stats",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris")
    assert "time to first token" in result.stderr and "tokens/s" in result.stderr


def test_missing_model_file_is_a_one_line_error_not_a_traceback(run_cli, tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert result.returncode == 2
    assert "nope.gguf" in result.stderr and "Traceback" not in result.stderr


def test_invalid_sampling_value_names_the_field(run_cli):
    result = run_cli("generate", "hi", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr and "Traceback" not in result.stderr
