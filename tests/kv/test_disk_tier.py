"""The prefix cache's disk tier: block files round-trip bit for bit, damaged files are never
served, the directory refuses a foreign identity, LRU keeps the budget, and on SmolLM2 with a
pool too small for every session the evicted prefixes come back from disk with the same greedy
tokens, across a restart too, with no block leaked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.kv.block_bytes import block_payload_bytes, read_blocks, write_blocks
from tokenmill.kv.block_pool import hash_block
from tokenmill.kv.disk_tier import BLOCK_SUFFIX, DiskTier, decode_block, encode_block
from tokenmill.kv.paged import PagedKVManager
from tokenmill.kv.quantized import allocate_kv_cache
from tokenmill.request import Request
from tokenmill.sampling.params import SamplingParams
from tokenmill.scheduler_output import EvictedBlock

BLOCK = 4
IDENTITY = {"model": "tiny", "kv_cache_dtype": "auto"}


def tiny_caches(kv_cache_dtype: str = "auto", num_blocks: int = 6) -> list:
    torch.manual_seed(0)
    caches = [allocate_kv_cache(kv_cache_dtype, num_blocks, BLOCK, 2, 8, torch.float32)]
    for cache in caches:
        tensors = (cache,) if isinstance(cache, torch.Tensor) else (cache.values, cache.scales)
        for tensor in tensors:
            tensor.view(torch.uint8).copy_(torch.randint_like(tensor.view(torch.uint8), 0, 255))
    return caches


def evicted(block_id: int, token: int) -> EvictedBlock:
    tokens = tuple(range(token, token + BLOCK))
    return EvictedBlock(block_id, hash_block(None, tokens), tokens, 0.0)


def open_tier(directory: Path, caches: list, budget: int = 1 << 20, **kwargs) -> DiskTier:
    return DiskTier(directory, budget, IDENTITY, BLOCK, block_payload_bytes(caches), **kwargs)


def files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*{BLOCK_SUFFIX}"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "fp8"])
def test_block_bytes_round_trip_in_the_pools_dtype(kv_cache_dtype):
    caches = tiny_caches(kv_cache_dtype)
    payloads = read_blocks(caches, [1, 4])
    copies = tiny_caches(kv_cache_dtype)
    write_blocks(copies, [0, 2], payloads)
    assert read_blocks(copies, [0, 2]) == payloads


def test_a_flipped_byte_or_a_torn_file_fails_the_checksum():
    data = encode_block((1, 2, 3, 4), b"payload-bytes")
    assert decode_block(data) == ((1, 2, 3, 4), b"payload-bytes")
    damaged = bytearray(data)
    damaged[-40] ^= 1
    assert decode_block(bytes(damaged)) is None
    assert decode_block(data[: len(data) // 2]) is None


def test_saved_blocks_are_written_and_load_back_bit_for_bit(tmp_path):
    caches = tiny_caches()
    tier = open_tier(tmp_path, caches)
    block = evicted(3, 100)
    expected = read_blocks(caches, [3])
    tier.save(caches, [block])
    tier.flush()
    assert len(files(tmp_path)) == 1 and tier.stats.writes == 1
    assert tier.lookup(block.block_hash, block.token_ids)
    tier.load(caches, [(block.block_hash, 5)])
    assert read_blocks(caches, [5]) == expected
    tier.close()


def test_a_hash_hit_with_other_token_ids_is_a_miss(tmp_path):
    caches = tiny_caches()
    tier = open_tier(tmp_path, caches)
    block = evicted(1, 0)
    tier.save(caches, [block])
    tier.flush()
    assert not tier.lookup(block.block_hash, (9, 9, 9, 9))
    tier.close()


def test_a_corrupted_file_is_deleted_and_missed(tmp_path):
    caches = tiny_caches()
    tier = open_tier(tmp_path, caches)
    block = evicted(2, 0)
    tier.save(caches, [block])
    tier.close()
    (path,) = files(tmp_path)
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    reopened = open_tier(tmp_path, caches)
    assert not reopened.lookup(block.block_hash, block.token_ids)
    assert reopened.stats.corrupt == 1 and files(tmp_path) == []
    reopened.close()


def test_lru_keeps_the_tier_within_its_byte_budget(tmp_path):
    caches = tiny_caches()
    one_file = open_tier(tmp_path / "probe", caches).file_bytes
    tier = open_tier(tmp_path / "tier", caches, budget=2 * one_file)
    first, second, third = evicted(0, 0), evicted(1, 10), evicted(2, 20)
    tier.save(caches, [first, second])
    assert tier.lookup(first.block_hash, first.token_ids)
    tier.load(caches, [(first.block_hash, 4)])  # first is now the most recently used
    tier.save(caches, [third])
    tier.flush()
    assert first.block_hash in tier and third.block_hash in tier
    assert second.block_hash not in tier and tier.stats.evictions == 1
    assert len(files(tmp_path / "tier")) == 2
    tier.close()


def saved(block_id: int, token: int, last_used: float, retained_until: float | None = None):
    tokens = tuple(range(token, token + BLOCK))
    return EvictedBlock(block_id, hash_block(None, tokens), tokens, last_used, retained_until)


def test_a_retained_block_outlives_lru_in_the_tier_until_its_time(tmp_path):
    caches = tiny_caches()
    now = [5000.0]
    one_file = open_tier(tmp_path / "probe", caches).file_bytes
    tier = open_tier(tmp_path / "tier", caches, budget=2 * one_file, clock=lambda: now[0])
    kept = saved(0, 0, last_used=4000.0, retained_until=5100.0)  # the least recently used
    tier.save(caches, [kept, saved(1, 10, last_used=4500.0)])
    tier.save(caches, [saved(2, 20, last_used=4600.0)])
    assert kept.block_hash in tier and tier.stats.evictions == 1
    now[0] = 5101.0
    tier.save(caches, [saved(3, 30, last_used=5101.0)])
    assert kept.block_hash not in tier  # its retention ended: plain LRU again
    tier.close()


def test_at_most_the_retained_fraction_of_the_budget_is_retained(tmp_path):
    caches = tiny_caches()
    one_file = open_tier(tmp_path / "probe", caches).file_bytes
    tier = open_tier(tmp_path / "tier", caches, budget=2 * one_file, clock=lambda: 5000.0)
    first = saved(0, 0, last_used=4000.0, retained_until=6000.0)
    second = saved(1, 10, last_used=4100.0, retained_until=6000.0)  # over the half: plain
    tier.save(caches, [first, second])
    tier.save(caches, [saved(2, 20, last_used=4200.0)])
    assert first.block_hash in tier and second.block_hash not in tier
    tier.close()


def test_the_ttl_spares_a_retained_disk_block_until_its_retention_ends(tmp_path):
    caches = tiny_caches()
    now = [5000.0]
    tier = open_tier(tmp_path, caches, cache_ttl_s=60, clock=lambda: now[0])
    kept = saved(0, 0, last_used=4900.0, retained_until=5300.0)
    plain = saved(1, 10, last_used=4900.0)
    tier.save(caches, [kept, plain])
    tier.expire()
    assert kept.block_hash in tier and plain.block_hash not in tier
    now[0] = 5300.0
    tier.expire()
    assert kept.block_hash not in tier
    tier.close()


def test_a_block_the_pool_evicts_while_retained_reaches_the_tier_with_its_retention(tmp_path):
    now = [5000.0]
    caches = tiny_caches(num_blocks=2)
    tier = open_tier(tmp_path, caches, clock=lambda: now[0])
    kv = PagedKVManager(2, BLOCK, max_retained_fraction=1.0, clock=lambda: now[0], disk_tier=tier)
    retained = Request("a", list(range(9)), SamplingParams(max_tokens=1, cache_ttl=300))
    assert kv.allocate_slots(retained, 8)
    kv.take_tier_transfers()  # the step that computes its blocks
    kv.free(retained)
    other = Request("b", list(range(100, 108)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(other, 8)  # only retained blocks are free: they yield
    saves, _ = kv.take_tier_transfers()
    assert [block.retained_until for block in saves] == [5300.0, 5300.0]
    tier.close()


def test_ttl_drops_disk_blocks_unused_for_longer(tmp_path):
    caches = tiny_caches()
    now = [5000.0]
    tier = open_tier(tmp_path, caches, cache_ttl_s=60, clock=lambda: now[0])
    old, recent = evicted(0, 0), EvictedBlock(1, hash_block(None, (7,) * 4), (7,) * 4, 5000.0)
    tier.save(caches, [EvictedBlock(0, old.block_hash, old.token_ids, 4900.0), recent])
    tier.flush()
    now[0] = 5030.0
    tier.expire()
    assert old.block_hash not in tier and recent.block_hash in tier
    assert len(files(tmp_path)) == 1 and tier.stats.expirations == 1
    tier.close()


def test_ttl_empties_both_tiers_through_the_kv_manager(tmp_path):
    now = [5000.0]
    caches = tiny_caches(num_blocks=3)
    tier = open_tier(tmp_path, caches, cache_ttl_s=60, clock=lambda: now[0])
    kv = PagedKVManager(3, BLOCK, cache_ttl_s=60, clock=lambda: now[0], disk_tier=tier)
    first = Request("a", list(range(9)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(first, 9)
    kv.take_tier_transfers()
    kv.free(first)  # two full blocks cached, and a partial one
    second = Request("b", list(range(100, 105)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(second, 5)  # evicts one of the first request's blocks
    saves, _ = kv.take_tier_transfers()
    tier.save(caches, saves)
    tier.flush()
    assert tier.num_blocks == 1 and len(kv.find_cached_prefix(first)) == 2
    kv.free(second)
    now[0] += 61
    kv.expire()
    assert tier.num_blocks == 0 and files(tmp_path) == []
    assert kv.find_cached_prefix(first) == [] and kv.pool.cached_blocks() == []
    tier.close()


def test_a_directory_written_under_another_identity_is_refused(tmp_path):
    caches = tiny_caches()
    open_tier(tmp_path, caches).close()
    with pytest.raises(ValueError, match="written for another model.*kv_cache_dtype"):
        DiskTier(
            tmp_path,
            1 << 20,
            {**IDENTITY, "kv_cache_dtype": "int8"},
            BLOCK,
            block_payload_bytes(caches),
        )


def test_a_budget_smaller_than_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kv_offload_bytes .* smaller than one block"):
        open_tier(tmp_path, tiny_caches(), budget=100)


def test_an_unwritable_directory_is_refused(tmp_path):
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(ValueError, match="kv_offload_dir .* is not writable"):
        open_tier(tmp_path / "a-file" / "tier", tiny_caches())


def test_the_offload_dir_needs_the_paged_cache():
    with pytest.raises(ValueError, match="kv_offload_dir needs kv_cache='paged'"):
        EngineArgs(kv_offload_dir="/tmp/x", kv_cache="contiguous")


# --- on SmolLM2 -------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
SESSION_TOKENS = 48  # three full blocks each, and a fourth once it generates


@pytest.fixture(scope="module")
def sessions(smollm) -> list[list[int]]:
    """Four sessions' first-turn prompts: distinct from their first token on."""
    vocab = smollm.config.vocab_size
    generator = torch.Generator().manual_seed(4)
    return [
        torch.randint(100, vocab, (SESSION_TOKENS,), generator=generator).tolist() for _ in range(4)
    ]


def make_engine(smollm, **kwargs) -> LLMEngine:
    """A pool of 8 blocks: two sessions fit, four do not."""
    per_block = smollm.config.num_hidden_layers * 2 * smollm.config.num_key_value_heads
    block_bytes = per_block * smollm.config.head_dim * 4 * 16
    args = EngineArgs(model=str(smollm.path), kv_cache_memory=8 * block_bytes, **kwargs)
    return LLMEngine(args, loaded=smollm)


def run_turns(engine: LLMEngine, prompts: list[list[int]]) -> list:
    """One request at a time, in order (as sessions' turns interleave)."""
    outputs = []
    for index, prompt in enumerate(prompts):
        engine.add_request(f"turn-{len(outputs)}-{index}-{id(prompt)}", prompt, GREEDY)
        while engine.has_unfinished_requests():
            outputs += [out for out in engine.step() if out.finished]
    return outputs


def second_turns(sessions: list[list[int]], firsts: list) -> list[list[int]]:
    return [
        [*prompt, *first.outputs[0].token_ids, 42]
        for prompt, first in zip(sessions, firsts, strict=True)
    ]


def assert_no_blocks_held(engine: LLMEngine) -> None:
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks


@pytest.fixture(scope="module")
def baseline(smollm, sessions) -> list[list[int]]:
    engine = make_engine(smollm)
    firsts = run_turns(engine, sessions)
    return [out.outputs[0].token_ids for out in run_turns(engine, second_turns(sessions, firsts))]


def test_second_turns_load_evicted_prefixes_from_disk_with_the_same_tokens(
    smollm, sessions, baseline, tmp_path
):
    engine = make_engine(smollm, kv_offload_dir=str(tmp_path))
    firsts = run_turns(engine, sessions)
    seconds = run_turns(engine, second_turns(sessions, firsts))
    assert [out.outputs[0].token_ids for out in seconds] == baseline
    assert seconds[0].num_disk_cached_tokens == SESSION_TOKENS  # its blocks were evicted
    assert all(out.num_cached_tokens >= SESSION_TOKENS for out in seconds)
    assert engine.disk_tier.stats.hits >= 2 * SESSION_TOKENS // 16
    assert_no_blocks_held(engine)
    engine.close()


def test_a_restarted_engine_serves_its_first_prefix_from_disk(smollm, sessions, baseline, tmp_path):
    first_engine = make_engine(smollm, kv_offload_dir=str(tmp_path))
    firsts = run_turns(first_engine, sessions)
    first_engine.close()
    restarted = make_engine(smollm, kv_offload_dir=str(tmp_path))
    (second,) = run_turns(restarted, second_turns(sessions, firsts)[3:])
    assert second.num_disk_cached_tokens == SESSION_TOKENS
    assert second.outputs[0].token_ids == baseline[3]
    assert_no_blocks_held(restarted)
    restarted.close()


def test_a_corrupted_block_file_is_recomputed_not_served(smollm, sessions, baseline, tmp_path):
    engine = make_engine(smollm, kv_offload_dir=str(tmp_path))
    firsts = run_turns(engine, sessions)
    engine.close()
    prompt = second_turns(sessions, firsts)[0]
    third_block = hash_block(
        hash_block(hash_block(None, prompt[:16]), prompt[16:32]), prompt[32:48]
    )
    path = tmp_path / f"{third_block.hex()}{BLOCK_SUFFIX}"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = make_engine(smollm, kv_offload_dir=str(tmp_path))
    (second,) = run_turns(restarted, [prompt])
    assert second.num_disk_cached_tokens == 32  # the two blocks before the damaged one
    assert second.outputs[0].token_ids == baseline[0]
    assert restarted.disk_tier.stats.corrupt == 1
    restarted.close()


def test_a_directory_of_another_kv_dtype_is_refused_at_start(smollm, tmp_path):
    make_engine(smollm, kv_offload_dir=str(tmp_path)).close()
    with pytest.raises(ValueError, match="written for another model or KV layout"):
        make_engine(smollm, kv_offload_dir=str(tmp_path), kv_cache_dtype="int8")
