"""`tokenmill chat`: a conversation on stdin, each reply seeing the ones before."""

from __future__ import annotations


def test_chat_repl_answers_and_keeps_history(run_cli):
    result = run_cli(
        "chat",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        stdin="What is the capital of France?\nAnd of Italy?\n\n",
    )
    assert result.returncode == 0, result.stderr
    replies = [line for line in result.stdout.split("> ") if line.strip()]
    assert len(replies) == 2
    assert "Paris" in replies[0] and "Rome" in replies[1]
