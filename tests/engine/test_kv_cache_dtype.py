"""`kv_cache_dtype` int8 / fp8 on the real models: the pool holds ~3.8x the tokens, greedy
tokens stay those of fp32 KV (but for near-ties), and every engine feature that reads or moves
KV (chunked prefill, prefix caching, copy-on-write forks, speculative drafts, Gemma 3's sliding
window) gives the same tokens as the plain quantized run."""

from __future__ import annotations

import pytest

from tokenmill import cli
from tokenmill.bench.quality import measure_quality
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.quant.calibration import token_windows
from tokenmill.sampling.params import SamplingParams

from .test_engine import VARIED_PROMPTS, random_prompt, run_all, tokens

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# A greedy token may flip where int8 KV puts fp32 KV's token this close (nats) behind its own
# choice. Measured on VARIED_PROMPTS: 3 of 16 prompts flip, at int8 gaps of 0.00003, 0.029 and
# 0.045 (fp32 KV's own top two were 0.017, 0.17 and 0.072 apart there).
NEAR_TIE_NATS = 0.1


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    args = EngineArgs(model=str(loaded.path), **{"kv_cache_memory": "32MiB", **kwargs})
    return LLMEngine(args, loaded=loaded)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def count_near_tie_flips(
    ours: list[RequestOutput], exact: list[RequestOutput], near_tie_nats: float
) -> int:
    """How many of `ours` (run with logprobs=2) leave `exact`'s greedy tokens, asserting each
    does so only where `exact`'s choice was its own runner-up within `near_tie_nats`
    (inclusive: bfloat16 logprobs come in steps, and a gap may be exactly the bound)."""
    flipped = 0
    for mine, theirs in zip(ours, exact, strict=True):
        at = first_difference(mine.outputs[0].token_ids, theirs.outputs[0].token_ids)
        if at is None:
            continue
        flipped += 1
        ranked = dict(mine.outputs[0].logprobs[at].top)
        exact_choice = theirs.outputs[0].token_ids[at]
        assert exact_choice in ranked  # our runner-up
        assert max(ranked.values()) - ranked[exact_choice] <= near_tie_nats
    return flipped


def test_int8_kv_gives_fp32_kv_greedy_tokens_but_at_near_ties(smollm):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    exact = run_all(make_engine(smollm), VARIED_PROMPTS, params)
    int8 = run_all(make_engine(smollm, kv_cache_dtype="int8"), VARIED_PROMPTS, params)
    assert count_near_tie_flips(int8, exact, NEAR_TIE_NATS) <= len(VARIED_PROMPTS) // 4


@pytest.mark.parametrize(("kv_cache_dtype", "max_kl"), [("int8", 0.01), ("fp8", 0.02)])
def test_quantized_kv_next_token_distributions_stay_close(smollm, kv_cache_dtype, max_kl):
    """Held-out text read back through the cache, as decoding reads it; on 32 windows of 256
    tokens `tokenmill eval` measured KL 0.0009 (int8) and 0.0061 (fp8)."""
    windows = token_windows(smollm.tokenizer, "heldout", 2, 48)
    quality = measure_quality(smollm.model, smollm.model, windows, kv_cache_dtype)
    assert 0 < quality.kl_divergence < max_kl and quality.top1_agreement > 0.9


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_same_memory_holds_about_four_times_the_tokens(smollm, kv_cache_dtype):
    """SmolLM2: 30 layers x 3 KV heads x K and V, each head 64 codes + a 4-byte scale."""
    exact = make_engine(smollm, kv_cache_memory="64MiB")
    quantized = make_engine(smollm, kv_cache_memory="64MiB", kv_cache_dtype=kv_cache_dtype)
    assert exact.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4
    assert quantized.kv_bytes_per_token == 2 * 30 * 3 * (64 + 4)
    assert quantized.num_blocks >= 3.7 * exact.num_blocks
    caches = quantized.runner.kv_caches
    allocated = sum(c.values.nbytes + c.scales.nbytes for c in caches)
    assert allocated == quantized.kv_cache_bytes <= 64 * 2**20


def test_a_bad_kv_cache_dtype_is_a_value_error_naming_the_field():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineArgs(kv_cache_dtype="int4")


def test_the_cli_flag_reaches_engine_args():
    ns = cli.build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8"])
    assert cli.engine_args_from(ns).kv_cache_dtype == "fp8"


@pytest.fixture(scope="module")
def int8_plain(smollm) -> list[list[int]]:
    return tokens(run_all(make_engine(smollm, kv_cache_dtype="int8"), VARIED_PROMPTS[:4], GREEDY))


def test_chunked_prefill_over_an_int8_cache_equals_one_prefill(smollm):
    """Later chunks attend over earlier chunks' dequantized K/V, one prefill over exact K/V."""
    prompt = random_prompt(7, 300)
    whole = make_engine(smollm, kv_cache_dtype="int8", enable_prefix_caching=False)
    chunked = make_engine(
        smollm, kv_cache_dtype="int8", enable_prefix_caching=False, max_num_batched_tokens=64
    )
    assert tokens(run_all(chunked, [prompt], GREEDY)) == tokens(run_all(whole, [prompt], GREEDY))


def test_an_int8_prefix_served_from_the_cache_gives_the_cold_tokens(smollm):
    prefix = random_prompt(11, 200)
    engine = make_engine(smollm, kv_cache_dtype="int8")
    run_all(engine, [[*prefix, 500, 501, 502]], GREEDY)
    second = run_all(engine, [[*prefix, 600, 601]], GREEDY)[0]
    assert second.num_cached_tokens >= 192
    cold = make_engine(smollm, kv_cache_dtype="int8", enable_prefix_caching=False)
    assert [second.outputs[0].token_ids] == tokens(run_all(cold, [[*prefix, 600, 601]], GREEDY))


def test_n_greedy_samples_fork_int8_blocks_with_their_scales(smollm, int8_plain):
    """The siblings decode from copies of the parent's last prompt block: codes without their
    scales would turn their KV into garbage."""
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    outputs: list[RequestOutput] = run_all(
        make_engine(smollm, kv_cache_dtype="int8"), VARIED_PROMPTS[:2], params
    )
    for output, expected in zip(outputs, int8_plain, strict=False):
        assert [sample.token_ids for sample in output.outputs] == [expected] * 3


@pytest.mark.parametrize(
    "speculation",
    [
        {"speculative_method": "draft", "draft_model": "self:layers=10"},  # shares the int8 KV
        {"speculative_method": "eagle"},  # its head keeps its own fp32 KV
        {"speculative_method": "ngram"},
    ],
    ids=["self-draft", "eagle", "ngram"],
)
def test_speculative_decoding_over_int8_kv_keeps_the_greedy_tokens(smollm, int8_plain, speculation):
    engine = make_engine(smollm, kv_cache_dtype="int8", **speculation)
    assert tokens(run_all(engine, VARIED_PROMPTS[:4], GREEDY)) == int8_plain


def test_gemma_sliding_window_layers_read_an_int8_cache(gemma):
    """600 tokens: past the 512-token window, in chunks that gather windowed context and then
    in windowed decodes; the greedy tokens are fp32 KV's."""
    prompt = random_prompt(3, 600)
    kwargs = {"max_num_batched_tokens": 256, "kv_cache_memory": "64MiB"}
    exact = tokens(run_all(make_engine(gemma, **kwargs), [prompt], GREEDY))
    int8 = tokens(run_all(make_engine(gemma, kv_cache_dtype="int8", **kwargs), [prompt], GREEDY))
    assert int8 == exact
