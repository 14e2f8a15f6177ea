"""The `tokenmill` command as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_generate_streams_paris_for_the_capital_of_france():
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


def test_missing_model_file_is_a_one_line_error_not_a_traceback(tmp_path):
    result = run_cli("generate", "hi", "--model", str(tmp_path / "nope.gguf"))
    assert result.returncode == 2
    assert "nope.gguf" in result.stderr and "Traceback" not in result.stderr


def test_invalid_sampling_value_names_the_field():
    result = run_cli("generate", "hi", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature" in result.stderr and "Traceback" not in result.stderr


def test_chat_repl_answers_and_keeps_history():
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "chat", "--temperature", "0", "--max-tokens", "24"],
        input="What is the capital of France?\nAnd of Italy?\n\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(replies) == 2
    assert "Paris" in replies[0] and "Rome" in replies[1]
