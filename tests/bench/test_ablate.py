"""`tokenmill bench ablate --quick` runs every experiment end to end on the real model."""

from __future__ import annotations

import json

from tokenmill.bench.ablate import EXPERIMENTS, FULL, QUICK

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_run_writes_table_json_and_one_png_per_experiment(tokenmill_cli, tmp_path):
    out = tmp_path / "ablate"
    result = tokenmill_cli(
        "bench", "ablate", "--quick", "--out-dir", str(out), "--kv-cache-memory", "32MiB"
    )
    assert result.returncode == 0, result.stderr
    payload = json.loads((out / "ablate.json").read_text())
    techniques = {row["technique"] for row in payload["rows"]}
    assert techniques == {"KV cache", "batching", "prefix caching", "chunked prefill", "KV memory"}
    for row in payload["rows"]:
        assert row["winner"] in {row["baseline"], row["candidate"], "tie"}, row
        assert row["margin"]
    assert set(payload["experiments"]) == set(EXPERIMENTS)
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
