"""`tokenmill bench anchors` on what needs no big install: the transformers anchor runs on the
interpreter running the tests (transformers is a test dependency); llama.cpp and vLLM would be
built or installed, which --no-install refuses, and the table says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenmill.bench.anchors import AnchorOptions, run_anchors
from tokenmill.config import EngineArgs


def test_transformers_beside_tokenmill_and_a_refused_llama_cpp(
    tokenmill_cli, tiny_workload, tiny_requests, tmp_path
):
    out = tmp_path / "anchors.json"
    result = tokenmill_cli(
        *("bench", "anchors", "--engines", "transformers,llama.cpp", "--no-install"),
        *("--workloads", str(tiny_workload), "--python", f"transformers={sys.executable}"),
        *("--threads", "1", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)),
        *("--kv-cache-memory", "32MiB"),
    )
    assert result.returncode == 1, result.stderr  # llama.cpp was not allowed to build
    payload = json.loads(out.read_text())
    by_engine = {r["engine"]: r for r in payload["results"]}
    assert set(by_engine) == {"tokenmill", "transformers", "llama.cpp"}
    expected_tokens = sum(r["max_tokens"] for r in tiny_requests)
    for engine in ("tokenmill", "transformers"):
        assert by_engine[engine]["error"] is None
        assert by_engine[engine]["output_tokens"] == expected_tokens
        assert by_engine[engine]["output_tokens_per_s"] > 0
    assert "no llama-server" in by_engine["llama.cpp"]["error"]
    # the model was exported once as an HF directory for the engines that need one
    assert (tmp_path / "cache" / "models").is_dir()

    header, _, *rows = result.stdout.strip().splitlines()
    assert "tiny.jsonl output tok/s" in header and "tokenmill / engine" in header
    cells = {row.split("|")[1].strip(): row for row in rows}
    assert "1.00x" in cells["tokenmill"]
    transformers_ratio = cells["transformers"].split("|")[4].strip()
    assert transformers_ratio.endswith("x") and float(transformers_ratio[:-1]) > 0
    assert "failed" in cells["llama.cpp"]


def test_unknown_engine_is_refused_before_anything_runs(tmp_path):
    options = AnchorOptions(cache_dir=tmp_path)
    with pytest.raises(ValueError, match="transformers, vllm, llama.cpp"):
        run_anchors(EngineArgs(), {}, ["tgi"], options)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("threads", 0, "threads"),
        ("llama_slots", 0, "llama_slots"),
        ("pythons", {"llama.cpp": Path("/usr/bin/python3")}, "python overrides"),
    ],
)
def test_bad_options_name_the_field(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        AnchorOptions(cache_dir=tmp_path, **{field: value})
