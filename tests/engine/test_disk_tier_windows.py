"""The disk tier with window trimming on Gemma 3: one file per KV-cache group and block, a hit
needs each full group's blocks and only the window's blocks of a sliding group, and the second
turns of sessions evicted from a small pool (or from a restarted engine) come back from disk
with the greedy tokens of an untrimmed engine without a tier, leaking no block."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tokenmill.engine.engine import LLMEngine
from tokenmill.kv.block_pool import hash_block
from tokenmill.kv.disk_tier import BLOCK_SUFFIX
from tokenmill.sampling.params import SamplingParams

from .test_engine import make_engine, random_prompt

BLOCK = 16
PROMPT_TOKENS = 560  # past the 512-token window: the sliding groups drop their first blocks
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
POOL_BLOCKS = 220  # one session's blocks in all six groups (6 x 36) fit, two do not


def run_turn(engine: LLMEngine, prompt: list[int]):
    engine.add_request(f"turn-{len(prompt)}-{prompt[0]}", prompt, GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
    (output,) = finished
    return output


def small_engine(gemma, directory: Path, **kwargs) -> LLMEngine:
    probe = make_engine(gemma, block_size=BLOCK, kv_cache_memory="1MiB", **kwargs)
    memory = POOL_BLOCKS * probe.kv_block_bytes
    return make_engine(
        gemma, block_size=BLOCK, kv_cache_memory=memory, kv_offload_dir=str(directory), **kwargs
    )


def assert_no_blocks_held(engine: LLMEngine) -> None:
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.fixture(scope="module")
def sessions() -> list[list[int]]:
    """Two sessions' first turns, and the first session's second turn (its prompt, a reply)."""
    first, other = (random_prompt(700 + i, PROMPT_TOKENS) for i in range(2))
    return [first, other, [*first, *random_prompt(9, 5)]]


@pytest.fixture(scope="module")
def expected(gemma, sessions) -> list[int]:
    """The second turn's greedy tokens, untrimmed and without a tier."""
    engine = make_engine(gemma, block_size=BLOCK, kv_window_trimming=False)
    return run_turn(engine, sessions[2]).outputs[0].token_ids


@pytest.fixture(scope="module")
def tiered(gemma, sessions, tmp_path_factory) -> dict:
    """The second session evicts the first one's blocks to disk; its second turn then loads
    them back. The engine is closed after, so every cached block is on disk."""
    directory = tmp_path_factory.mktemp("tier")
    engine = small_engine(gemma, directory)
    assert engine.kv_groups.trims
    run_turn(engine, sessions[0])
    run_turn(engine, sessions[1])
    second = run_turn(engine, sessions[2])
    free, total = engine.kv_manager.num_free_blocks, engine.kv_manager.num_blocks
    engine.close()
    return {"directory": directory, "second": second, "free": free, "total": total}


def test_an_evicted_session_comes_back_from_every_groups_files_with_the_same_tokens(
    tiered, expected
):
    assert tiered["second"].outputs[0].token_ids == expected
    assert tiered["second"].num_disk_cached_tokens > 0
    files = tiered["directory"].glob(f"*{BLOCK_SUFFIX}")
    assert {bytes.fromhex(path.stem)[-1] for path in files} == set(range(6))  # a tag per group
    assert tiered["free"] == tiered["total"]


def test_a_restart_hits_with_only_the_windows_blocks_of_sliding_groups_on_disk(
    gemma, sessions, tiered, expected, tmp_path
):
    directory = tmp_path / "tier"
    shutil.copytree(tiered["directory"], directory)
    prompt = sessions[2]
    num_hit = (len(prompt) - 1) // BLOCK
    window_start = (num_hit * BLOCK - gemma.config.sliding_window + 1) // BLOCK
    assert window_start > 0
    hashes, parent = [], None
    for i in range(num_hit):
        parent = hash_block(parent, prompt[i * BLOCK : (i + 1) * BLOCK])
        hashes.append(parent)
    for group in range(1, 6):  # the sliding groups' blocks before the window
        for block_hash in hashes[:window_start]:
            (directory / f"{(block_hash + bytes([group])).hex()}{BLOCK_SUFFIX}").unlink()
    restarted = small_engine(gemma, directory)
    second = run_turn(restarted, prompt)
    assert second.num_cached_tokens == second.num_disk_cached_tokens == num_hit * BLOCK
    assert restarted.disk_tier.stats.hits == num_hit + 5 * (num_hit - window_start)
    assert second.outputs[0].token_ids == expected
    assert_no_blocks_held(restarted)
    restarted.close()


def test_a_directory_written_without_trimming_is_refused_with_it(gemma, tmp_path):
    small_engine(gemma, tmp_path, kv_window_trimming=False).close()
    with pytest.raises(ValueError, match="written for another model or KV layout.*kv_groups"):
        small_engine(gemma, tmp_path)
