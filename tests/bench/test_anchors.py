"""`tokenmill bench anchors` on what needs no big install: the transformers anchor runs on the
interpreter running the tests (transformers is a test dependency); llama.cpp and vLLM would be
built or installed, which --no-install refuses, and the table says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tokenmill.bench.anchors import AnchorOptions, check_token_ids, run_anchors
from tokenmill.bench.workloads import BenchRequest, load_workload
from tokenmill.config import EngineArgs
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.gguf_model import gguf_model_config
from tokenmill.loader.hf_dir import hf_model_config
from tokenmill.loader.resolve import resolve_model
from tokenmill.loader.tokenizer import Tokenizer


def test_transformers_beside_tokenmill_in_its_dtype_and_a_refused_llama_cpp(
    tokenmill_cli, tiny_workload, tiny_requests, tmp_path
):
    out = tmp_path / "anchors.json"
    result = tokenmill_cli(
        *("bench", "anchors", "--engines", "transformers,llama.cpp", "--no-install"),
        *("--workloads", str(tiny_workload), "--python", f"transformers={sys.executable}"),
        *("--threads", "1", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)),
        *("--kv-cache-memory", "32MiB", "--dtype", "bfloat16"),
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
    assert by_engine["transformers"]["notes"].startswith("bfloat16,")
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


def test_a_dtype_the_script_anchors_cannot_load_is_refused_before_anything_runs(tmp_path):
    options = AnchorOptions(cache_dir=tmp_path)
    with pytest.raises(ValueError, match="--dtype float16: the transformers and vllm anchors"):
        run_anchors(EngineArgs(dtype="float16"), {}, ["vllm"], options)


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


def test_token_ids_outside_the_models_vocabulary_are_refused_naming_the_request():
    workloads = {"w": [BenchRequest([5, 6], None, 1), BenchRequest([7, 49152], None, 1)]}
    check_token_ids(workloads, 49153)
    with pytest.raises(ValueError, match="workload w: request 1 holds token id 49152"):
        check_token_ids(workloads, 49152)


def test_builtin_workload_ids_lie_below_gemmas_own_vocabulary():
    vocab_size = gguf_model_config(GGUFFile(resolve_model("gemma3-270m"))).vocab_size
    check_token_ids({name: load_workload(name) for name in ("batch64", "single")}, vocab_size)


def test_gemma_runs_on_transformers_from_the_directory_exported_from_its_gguf(
    tokenmill_cli, tiny_workload, tiny_requests, tmp_path
):
    """The HF directory carries Gemma's own config (architecture, vocabulary, sliding window,
    tied head) and tokenizer, read from the GGUF: transformers runs it, and tokenmill reads it
    back to the GGUF's config and tokens."""
    cache = tmp_path / "cache"
    out = tmp_path / "anchors.json"
    result = tokenmill_cli(
        *("bench", "anchors", "--model", "gemma3-270m", "--engines", "transformers"),
        *("--workloads", str(tiny_workload), "--python", f"transformers={sys.executable}"),
        *("--threads", "1", "--cache-dir", str(cache), "--json", str(out), "--no-install"),
        *("--kv-cache-memory", "64MiB"),
    )
    assert result.returncode == 0, result.stderr
    by_engine = {r["engine"]: r for r in json.loads(out.read_text())["results"]}
    assert by_engine["transformers"]["output_tokens"] == sum(r["max_tokens"] for r in tiny_requests)

    gguf = GGUFFile(resolve_model("gemma3-270m"))
    (exported,) = (cache / "models").iterdir()
    config = hf_model_config(exported)
    assert config == gguf_model_config(gguf)
    assert config.architecture == "Gemma3ForCausalLM" and config.tie_word_embeddings
    theirs = Tokenizer.from_pretrained_dir(exported)
    ours = Tokenizer.from_gguf_metadata(gguf.metadata)
    assert theirs.chat_template == ours.chat_template
    assert "<start_of_turn>" in theirs.chat_template
    text = "<start_of_turn>user\nHi there<end_of_turn>\n"
    assert theirs.encode(text) == ours.encode(text)


def test_setup_only_without_install_names_what_is_missing(tokenmill_cli, tmp_path):
    result = tokenmill_cli(
        *("bench", "anchors", "--engines", "llama-bench", "--setup-only", "--no-install"),
        *("--cache-dir", str(tmp_path)),
    )
    assert result.returncode == 2
    assert "no llama-server" in result.stderr and "--no-install" in result.stderr
