"""Tiny workloads and the `tokenmill` command as a user runs it, shared by the bench tests."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

RunCli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def tiny_requests() -> list[dict[str, Any]]:
    """Three requests, one of them text, a few tokens each."""
    return [
        {"prompt_token_ids": [504, 3458, 282, 1000, 2000, 3000], "max_tokens": 5},
        {"prompt_token_ids": [1200, 1300, 1400], "max_tokens": 3},
        {"prompt": "The capital of France is", "max_tokens": 4},
    ]


@pytest.fixture
def tiny_workload(tmp_path: Path, tiny_requests: list[dict[str, Any]]) -> Path:
    """`tiny_requests` as a JSONL workload file."""
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in tiny_requests) + "\n", encoding="utf-8")
    return path


def _run_tokenmill(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(scope="session")
def tokenmill_cli() -> RunCli:
    return _run_tokenmill
