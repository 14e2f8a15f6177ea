"""Benchmark workloads: the same token ids on every engine, so numbers compare."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int] | None
    prompt: str | None
    max_tokens: int


def batch64() -> list[BenchRequest]:
    """64 random-token prompts of 32-256 tokens, each generating 32-256 tokens."""
    rng = random.Random(1)
    requests = []
    for _ in range(64):
        n = rng.randint(32, 256)
        prompt = [rng.randrange(100, 49000) for _ in range(n)]
        requests.append(BenchRequest(prompt, None, rng.randint(32, 256)))
    return requests


def single() -> list[BenchRequest]:
    """One 32-token prompt generating 128 tokens: single-stream decode speed."""
    rng = random.Random(0)
    return [BenchRequest([rng.randrange(100, 49000) for _ in range(32)], None, 128)]


BUILTIN_WORKLOADS = {"batch64": batch64, "single": single}


def load_workload(name: str) -> list[BenchRequest]:
    """A built-in name, or a JSONL file of {"prompt" or "prompt_token_ids", "max_tokens"}."""
    if name in BUILTIN_WORKLOADS:
        return BUILTIN_WORKLOADS[name]()
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"workload must be one of {', '.join(BUILTIN_WORKLOADS)} or a JSONL file; "
            f"{path} does not exist"
        )
    requests = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            ids, prompt, max_tokens = (
                row.get("prompt_token_ids"),
                row.get("prompt"),
                row["max_tokens"],
            )
        except (json.JSONDecodeError, KeyError, AttributeError) as exc:
            raise ValueError(f"{path}:{number}: expected a JSON object with max_tokens") from exc
        if (ids is None) == (prompt is None):
            raise ValueError(f"{path}:{number}: give exactly one of prompt or prompt_token_ids")
        requests.append(BenchRequest(ids, prompt, int(max_tokens)))
    if not requests:
        raise ValueError(f"{path}: no requests in the workload file")
    return requests
