"""`tokenmill batch`: a JSONL file of prompts in, a JSONL file of completions out, line for line
in the input's order, resumable.

An input line is an object with `prompt` (text) or `messages` (a chat), and optionally its own
`max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop` (the command's flags otherwise)
and an `id` copied to its output. An output line: `index` (the input line's, from 0), `id`,
`text`, `finish_reason`, `prompt_tokens`, `completion_tokens`.

Output is appended in input order and flushed chunk by chunk, so an interrupted run leaves a
prefix of the finished file; a rerun keeps the complete lines already there and starts at the
first line missing. The work itself runs in this process (`run_local`) or on Ray Data over a
pool of engine actors (tokenmill.cluster.batch_ray).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.engine.engine import PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams

LINE_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
CHUNK_LINES = 32
"""Lines per engine batch and per flush: what an interruption can cost."""


@dataclass(frozen=True)
class BatchLine:
    index: int
    record: dict[str, Any]


def read_lines(path: Path) -> list[BatchLine]:
    """Every non-blank input line; a malformed one is a ValueError naming its line number."""
    lines = []
    with path.open(encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
            if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
                raise ValueError(f"{path}:{number}: give an object with `prompt` or `messages`")
            lines.append(BatchLine(len(lines), record))
    return lines


def finished_count(path: Path) -> int:
    """How many output lines are complete, in order from index 0; a torn last line (the run
    stopped mid-write) is cut off so appending continues cleanly."""
    if not path.exists():
        return 0
    done, keep = 0, 0
    with path.open("rb") as f:
        for raw in f:
            try:
                index = json.loads(raw)["index"] if raw.endswith(b"\n") else None
            except (json.JSONDecodeError, KeyError, TypeError):
                index = None
            if index != done:
                break
            done += 1
            keep += len(raw)
    with path.open("r+b") as f:
        f.truncate(keep)
    return done


def params_for(record: dict[str, Any], default: SamplingParams) -> SamplingParams:
    given = {k: record[k] for k in LINE_SAMPLING_FIELDS if record.get(k) is not None}
    return replace(default, **given) if given else default


def prompt_of(llm: LLM, record: dict[str, Any]) -> PromptInput:
    """A chat is rendered with the model's template, as LLM.chat renders it."""
    if "messages" not in record:
        return str(record["prompt"])
    text = llm.tokenizer.apply_chat_template(record["messages"])
    return {
        "prompt": text,
        "prompt_token_ids": llm.tokenizer.encode(text, add_special_tokens=False),
    }


def complete(llm: LLM, lines: Sequence[BatchLine], default: SamplingParams) -> list[str]:
    """The output lines (JSON text, newline-terminated) of `lines`, in their order."""
    prompts = [prompt_of(llm, line.record) for line in lines]
    params = [params_for(line.record, default) for line in lines]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [output_line(line, out) for line, out in zip(lines, outputs, strict=True)]


def output_line(line: BatchLine, output: RequestOutput) -> str:
    completion = output.outputs[0]
    return (
        json.dumps(
            {
                "index": line.index,
                "id": line.record.get("id"),
                "text": completion.text,
                "finish_reason": completion.finish_reason,
                "prompt_tokens": len(output.prompt_token_ids),
                "completion_tokens": len(completion.token_ids),
            },
            ensure_ascii=False,
        )
        + "\n"
    )


def chunks(lines: Sequence[BatchLine], size: int) -> Iterator[Sequence[BatchLine]]:
    for start in range(0, len(lines), size):
        yield lines[start : start + size]


def run_local(llm: LLM, lines: Sequence[BatchLine], output: Path, default: SamplingParams) -> None:
    """Complete `lines` in this process, appending to `output` chunk by chunk."""
    from tqdm import tqdm

    with output.open("a", encoding="utf-8") as out, tqdm(total=len(lines), unit="line") as bar:
        for chunk in chunks(lines, CHUNK_LINES):
            out.writelines(complete(llm, chunk, default))
            out.flush()
            bar.update(len(chunk))
