"""The speculative tests' prompt; they run the real SmolLM2 engine through `runner`
(tests/conftest.py)."""

from __future__ import annotations

import pytest

PASSAGE = (
    "The river Thames flows through southern England, passing through Oxford, Reading and "
    "London before it reaches the North Sea. It is about 346 kilometres long, and its tidal "
    "reach ends at Teddington Lock."
)


@pytest.fixture(scope="session")
def rewrite_prompt(runner) -> list[int]:
    """An input-grounded task: the answer repeats the passage, so prompt lookup hits."""
    return runner.chat(f"Repeat this passage word for word:\n\n{PASSAGE}")
