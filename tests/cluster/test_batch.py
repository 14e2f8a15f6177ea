"""`tokenmill batch`: greedy outputs equal LLM.generate's, line for line in input order; an
interrupted run resumes where it stopped; `--replicas 2` on Ray Data gives the same file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenmill import cli
from tokenmill.cluster.batch_job import CHUNK_LINES, finished_count, read_lines, run_local
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams

NUM_PROMPTS = 200
MAX_TOKENS = 4
ENGINE_FLAGS = ["--kv-cache-memory", "64MiB", "--temperature", "0", "--max-tokens", str(MAX_TOKENS)]


def prompts() -> list[str]:
    return [f"Fact number {i} about the sea:" for i in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def input_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("batch") / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": p, "id": f"q{i}"}) + "\n" for i, p in enumerate(prompts()))
    )
    return path


@pytest.fixture(scope="module")
def llm(smollm_path: Path) -> LLM:
    return LLM(str(smollm_path), kv_cache_memory="64MiB")


@pytest.fixture(scope="module")
def expected_texts(llm: LLM) -> list[str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return [o.outputs[0].text for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def finished_file(tmp_path_factory, input_file: Path, smollm_path: Path) -> Path:
    output = tmp_path_factory.mktemp("batch") / "out.jsonl"
    argv = [
        "batch",
        "--input",
        str(input_file),
        "--output",
        str(output),
        "--model",
        str(smollm_path),
    ]
    assert cli.main(argv + ENGINE_FLAGS) == 0
    return output


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_gives_llm_generates_greedy_outputs_in_input_order(finished_file, expected_texts):
    rows = read(finished_file)
    assert [r["index"] for r in rows] == list(range(NUM_PROMPTS))
    assert [r["id"] for r in rows] == [f"q{i}" for i in range(NUM_PROMPTS)]
    assert [r["text"] for r in rows] == expected_texts


def test_interrupted_batch_resumes_without_redoing_finished_lines(
    tmp_path, input_file, smollm_path, finished_file
):
    num_lines = 3 * CHUNK_LINES
    small_input = tmp_path / "in.jsonl"
    small_input.write_text("".join(input_file.read_text().splitlines(keepends=True)[:num_lines]))
    output = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "tokenmill.cli", "batch", "--input", str(small_input)]
    argv += ["--output", str(output), "--model", str(smollm_path), *ENGINE_FLAGS]
    first = subprocess.Popen(argv, stderr=subprocess.DEVNULL, env=os.environ.copy())
    deadline = time.monotonic() + 300
    while not output.exists() or len(output.read_bytes().splitlines()) < CHUNK_LINES:
        assert first.poll() is None and time.monotonic() < deadline, "no chunk was written"
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    with output.open("ab") as f:
        f.write(b'{"index": 9')  # a line torn by the kill
    done_before = output.read_bytes().splitlines()[:-1]
    assert 0 < len(done_before) < num_lines

    rerun = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=True)
    assert f"{len(done_before)} of {num_lines} lines already done" in rerun.stderr
    assert output.read_bytes().splitlines()[: len(done_before)] == done_before
    expected = finished_file.read_text().splitlines(keepends=True)[:num_lines]
    assert output.read_text() == "".join(expected)


def test_finished_count_stops_at_the_first_line_out_of_order(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"index": 0}\n{"index": 1}\n{"index": 3}\n')
    assert finished_count(path) == 2
    assert path.read_text() == '{"index": 0}\n{"index": 1}\n'


def test_malformed_input_line_is_an_error_naming_its_line(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    argv = ["batch", "--input", str(path), "--output", str(tmp_path / "out.jsonl")]
    with pytest.raises(ValueError, match=r"in.jsonl:2"):
        cli.build_parser().parse_args(argv).func(cli.build_parser().parse_args(argv))


def test_batch_on_ray_data_with_two_replicas_writes_the_same_file(
    tmp_path, input_file, smollm_path, finished_file
):
    small_input = tmp_path / "in.jsonl"
    small_input.write_text("".join(input_file.read_text().splitlines(keepends=True)[:48]))
    output = tmp_path / "out.jsonl"
    argv = ["batch", "--input", str(small_input), "--output", str(output)]
    argv += ["--model", str(smollm_path), "--replicas", "2", *ENGINE_FLAGS]
    assert cli.main(argv) == 0
    expected = "".join(finished_file.read_text().splitlines(keepends=True)[:48])
    assert output.read_text() == expected


def test_a_chat_line_is_answered_as_llm_chat_answers_it(tmp_path, llm):
    messages = [{"role": "user", "content": "Name a colour."}]
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    output = tmp_path / "out.jsonl"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    run_local(llm, read_lines(path), output, params)
    (expected,) = llm.chat(messages, params, use_tqdm=False)
    assert read(output)[0]["text"] == expected.outputs[0].text
