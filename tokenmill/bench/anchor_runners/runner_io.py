"""What every anchor runner shares: its command line, the workload it reads, the result it
writes. Standard library only: it runs in venvs that do not have tokenmill."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model-dir", required=True, help="Hugging Face model directory")
    parser.add_argument("--workload", required=True, help="JSON: name and requests")
    parser.add_argument("--out", required=True, help="where the result JSON goes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size (HF)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="weights and compute"
    )
    return parser.parse_args()


def load_workload(path: str) -> tuple[str, list[dict[str, Any]]]:
    """(name, [{"prompt_token_ids": [...], "max_tokens": n}, ...])."""
    payload = json.loads(Path(path).read_text(encoding="utf-8"))
    return payload["name"], payload["requests"]


def write_result(
    path: str,
    engine: str,
    version: str,
    workload: str,
    requests: list[dict[str, Any]],
    output_tokens: int,
    elapsed_s: float,
    notes: str,
) -> None:
    result = {
        "engine": engine,
        "version": version,
        "workload": workload,
        "num_requests": len(requests),
        "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in requests),
        "output_tokens": output_tokens,
        "elapsed_s": elapsed_s,
        "output_tokens_per_s": output_tokens / elapsed_s,
        "notes": notes,
    }
    Path(path).write_text(json.dumps(result, indent=2), encoding="utf-8")
