"""`tokenmill bench ablate --quick` runs every experiment end to end on the real model."""

from __future__ import annotations

import json

from tokenmill.bench.ablate import DEFAULT_EXPERIMENTS, FULL, QUICK
from tokenmill.bench.workloads import load_workload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_table_json_and_one_png_per_experiment(tokenmill_cli, tmp_path):
    out = tmp_path / "ablate"
    result = tokenmill_cli(
        "bench", "ablate", "--quick", "--out-dir", str(out), "--kv-cache-memory", "32MiB"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads((out / "ablate.json").read_text())
    techniques = {row["technique"] for row in payload["rows"]}
    assert techniques == {
        "KV cache",
        "batching",
        "prefix caching",
        "chunked prefill",
        "KV memory",
        "speculative decoding (ngram)",
        "speculative decoding (eagle)",
        "speculative decoding (medusa)",
        "speculative decoding (draft)",
        "speculative decoding (ngram, batch)",
        "native decode loop",
        "prepacked weights",
    }
    for row in payload["rows"]:
        assert row["winner"] in {row["baseline"], row["candidate"], "tie"}, row
        assert row["margin"]
    assert set(payload["experiments"]) == set(DEFAULT_EXPERIMENTS)
    for experiment in payload["experiments"].values():
        assert (out / experiment["plot"]).read_bytes()[:8] == PNG_MAGIC
    table = (out / "ablate.md").read_text()
    assert table.strip() in result.stdout
    assert len(table.strip().splitlines()) == 2 + len(payload["rows"])

    # What the techniques must show even at toy sizes (counts, not timings):
    data = {name: e["data"] for name, e in payload["experiments"].items()}
    memory = data["kv-memory"]
    assert memory["bytes_per_token_formula"] == memory["bytes_per_token_measured"]
    assert memory["max_concurrent_requests"]["contiguous"] == QUICK.memory_pool_requests
    assert memory["max_concurrent_requests"]["paged"] > QUICK.memory_pool_requests
    assert memory["unused_fraction"]["paged"] < memory["unused_fraction"]["contiguous"]
    cached = data["prefix-caching"]["cached_prompt_tokens"]
    assert cached["off"] == [0] * QUICK.prefix_requests
    assert all(n >= QUICK.prefix_tokens - 16 for n in cached["on"][1:])
    assert data["chunked-prefill"]["budgets"] == {"off": 2048, "on": QUICK.chunk_budget}
    assert all(case["outputs_match"] for case in data["decode-loop"].values())


def test_speculative_rows_compare_off_and_on_with_identical_greedy_outputs(tokenmill_cli, tmp_path):
    out = tmp_path / "ablate"
    result = tokenmill_cli(
        "bench",
        "ablate",
        "--quick",
        "--only",
        "speculative,speculative-batch",
        "--out-dir",
        str(out),
        "--kv-cache-memory",
        "32MiB",
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads((out / "ablate.json").read_text())
    assert set(payload["experiments"]) == {"speculative", "speculative-batch"}
    for experiment in payload["experiments"].values():
        assert (out / experiment["plot"]).read_bytes()[:8] == PNG_MAGIC
    rows = payload["rows"]
    assert [row["candidate"] for row in rows] == [
        *["ngram"] * 4,
        *["eagle"] * 4,
        *["medusa"] * 4,
        *["draft"] * 4,
        "forced on",
        "default policy",
    ]
    assert all(row["baseline"] == "off" for row in rows)
    assert all(
        "greedy outputs identical: yes" in row["metric"] for row in rows if row["unit"] == "tok/s"
    )

    single = payload["experiments"]["speculative"]["data"]
    cases = (("ngram", "rewrite"), ("eagle", "chat"), ("medusa", "chat"), ("draft", "chat"))
    for method, workload in cases:
        runs = single[method]
        assert runs["workload"] == workload and runs["outputs_match"] is True
        assert runs["off"]["spec_mean_accepted_length"] == 0.0  # nothing was verified
        assert runs["on"]["spec_mean_accepted_length"] >= 1.0
        assert runs["off"]["output_tokens"] == runs["on"]["output_tokens"]
    assert single["ngram"]["on"]["spec_acceptance_rate"] > 0  # the output copies the prompt
    batch = payload["experiments"]["speculative-batch"]["data"]
    assert batch["outputs_match"] == {"forced on": True, "default policy": True}
    results = batch["results"]
    assert {r["max_concurrent_requests"] for r in results.values()} == {QUICK.spec_batch_requests}
    assert results["off"]["spec_mean_accepted_length"] == 0.0


def test_only_with_an_unknown_experiment_fails_before_loading_anything(tokenmill_cli):
    result = tokenmill_cli("bench", "ablate", "--quick", "--only", "kv-cache,nope")
    assert result.returncode == 2
    assert "nope" in result.stderr and "Traceback" not in result.stderr


def test_full_sizes_are_the_issue_workloads():
    assert (FULL.batch_requests, FULL.batch_prompt_len, FULL.batch_max_tokens) == (
        64,
        (32, 256),
        (32, 256),
    )
    assert (FULL.kv_new_tokens, FULL.prefix_tokens, FULL.chunk_prompt_tokens) == (256, 1024, 2000)
    assert FULL.spec_rewrite_tokens == load_workload("rewrite")[0].max_tokens
    assert FULL.spec_chat_tokens == load_workload("chat")[0].max_tokens
