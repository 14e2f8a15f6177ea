"""The `tokenmill` command run as a user runs it: a fresh process, its output captured."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

RunCli = Callable[..., subprocess.CompletedProcess[str]]


def _run_tokenmill(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="session")
def run_cli() -> RunCli:
    return _run_tokenmill
