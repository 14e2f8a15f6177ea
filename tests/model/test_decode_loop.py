"""The native decode loop runs the same kernels in the same order as the Python layers: on the
real models (SmolLM2 and Gemma 3) its tokens and log-probabilities are exactly theirs, for every
weight format, model dtype and KV dtype it covers, for speculative verification chunks too; where
it has no kernel it stays off."""

from __future__ import annotations

import pytest
import torch

from tokenmill import cli
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.kernels import ops
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.decode_loop import NativeDecodeLoop
from tokenmill.sampling.params import SamplingParams

from ..engine.test_engine import VARIED_PROMPTS, run_all

pytestmark = pytest.mark.skipif(ops.backend() != "native", reason="needs the native kernels")

SCORED = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)


def make_engine(loaded: LoadedModel, decode_loop: str, **kwargs) -> LLMEngine:
    kwargs.setdefault("kv_cache_memory", "32MiB")
    args = EngineArgs(model=str(loaded.path), decode_loop=decode_loop, **kwargs)
    return LLMEngine(args, loaded=loaded)


def scored(outputs: list[RequestOutput]) -> list[tuple[list[int], list]]:
    return [(out.outputs[0].token_ids, out.outputs[0].logprobs) for out in outputs]


def assert_loops_agree(loaded: LoadedModel, prompts, params=SCORED, **kwargs) -> LLMEngine:
    native = make_engine(loaded, "native", **kwargs)
    assert native.runner.decode_loop is not None
    python = make_engine(loaded, "python", **kwargs)
    assert python.runner.decode_loop is None
    assert scored(run_all(native, prompts, params)) == scored(run_all(python, prompts, params))
    return native


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_float32_model_gives_the_python_layers_exact_logprobs(smollm, kv_cache_dtype):
    """Eight prompts decoding together (block boundaries crossed at different steps), then the
    stragglers alone: batch sizes 1..8 all go through the loop."""
    assert_loops_agree(smollm, VARIED_PROMPTS[:8], kv_cache_dtype=kv_cache_dtype)


def test_a_long_context_decodes_in_partitions_as_in_the_python_layers(smollm):
    """Past 512 tokens decode attention merges partitions through the loop's scratch buffer: a
    1,100-token context (3 partitions) beside a short one."""
    long_prompt = {"prompt_token_ids": [100 + (i * 7919) % 30000 for i in range(1100)]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    assert_loops_agree(smollm, [long_prompt, VARIED_PROMPTS[0]], params, kv_cache_memory="128MiB")


@pytest.mark.parametrize("quantization", ["int8", "gguf", "fp8"])
def test_quantized_models_give_the_python_layers_exact_logprobs(quantized_smollm, quantization):
    assert_loops_agree(quantized_smollm(quantization), VARIED_PROMPTS[:4])


def test_gemma3_gives_the_python_layers_exact_logprobs(gemma, monkeypatch):
    """Gemma's extra norms, tanh-GELU and its local layers' sliding window. Sliding past the
    real window (512) would take long prompts, so the local layers get a window of 8 here."""
    for layer in gemma.model.layers:
        if layer.self_attn.window is not None:
            monkeypatch.setattr(layer.self_attn, "window", 8)
    assert_loops_agree(gemma, VARIED_PROMPTS[:3])


needs_bfloat16_linear = pytest.mark.skipif(
    ops.backend() != "native",
    reason="a bfloat16 model's loop runs its products on the native bfloat16 kernels",
)


@needs_bfloat16_linear
def test_bfloat16_model_gives_the_python_layers_exact_logprobs(bf16_smollm):
    engine = assert_loops_agree(bf16_smollm, VARIED_PROMPTS[:8], dtype="bfloat16")
    assert engine.runner.decode_loop.layers.max_tokens == ops.PREPACKED_MAX_ROWS


@needs_bfloat16_linear
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_bfloat16_model_over_8_bit_kv_gives_the_python_layers_exact_logprobs(
    bf16_smollm, kv_cache_dtype
):
    assert_loops_agree(
        bf16_smollm, VARIED_PROMPTS[:4], dtype="bfloat16", kv_cache_dtype=kv_cache_dtype
    )


@needs_bfloat16_linear
def test_bfloat16_gemma3_gives_the_python_layers_exact_logprobs(monkeypatch):
    """Gemma's norms in bfloat16, and its tanh-GELU taken through torch in the loop too."""
    gemma = load_model("gemma3-270m", torch.bfloat16)
    for layer in gemma.model.layers:
        if layer.self_attn.window is not None:
            monkeypatch.setattr(layer.self_attn, "window", 8)
    assert_loops_agree(gemma, VARIED_PROMPTS[:3], dtype="bfloat16")


def test_speculative_verification_chunks_run_through_the_loop(smollm, monkeypatch):
    seen: list[int] = []
    original = NativeDecodeLoop.__call__

    def counting(self, input_ids, positions, meta):
        seen.append(meta.num_tokens)
        return original(self, input_ids, positions, meta)

    monkeypatch.setattr(NativeDecodeLoop, "__call__", counting)
    passage = "The quick brown fox jumps over the lazy dog. " * 4
    prompts = [f"Repeat exactly: {passage}\n{passage}"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    assert_loops_agree(smollm, prompts, params, speculative_method="ngram")
    assert max(seen) > 1  # a request's drafts were verified in one loop call


def test_applies_to_decodes_and_short_chunks_over_cache_only(smollm, quantized_smollm):
    def meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
        tables = [list(range(8))] * len(query_lens)
        return AttentionMetadata.build(query_lens, seq_lens, tables, 16, [0] * sum(query_lens))

    loop = make_engine(smollm, "native", prepack_weights=False).runner.decode_loop
    assert loop is not None and loop.layers.max_tokens == ops.SKINNY_MAX_ROWS
    assert loop.applies(meta([1, 1, 5], [30, 40, 50]))
    assert not loop.applies(meta([1, 20], [30, 20]))  # a prompt prefill
    assert loop.applies(meta([1] * ops.SKINNY_MAX_ROWS, [30] * ops.SKINNY_MAX_ROWS))
    assert not loop.applies(meta([1] * 33, [30] * 33))  # beyond the skinny kernels
    packed = make_engine(smollm, "native").runner.decode_loop  # packed weights: the blocked GEMM
    assert packed is not None and packed.layers.max_tokens == ops.PREPACKED_MAX_ROWS
    assert packed.applies(meta([1] * 64, [30] * 64))
    quantized = make_engine(quantized_smollm("gguf"), "native").runner.decode_loop
    assert quantized is not None and quantized.layers.max_tokens == ops.QUANT_KERNEL_MAX_ROWS


def test_stays_off_where_a_kernel_is_missing(smollm, bf16_smollm, monkeypatch):
    assert make_engine(smollm, "native", kv_cache="none").runner.decode_loop is None
    unpacked = make_engine(bf16_smollm, "native", dtype="bfloat16", prepack_weights=False)
    assert unpacked.runner.decode_loop is None
    monkeypatch.setattr(ops, "_NATIVE", None)
    assert make_engine(smollm, "native").runner.decode_loop is None


def test_decode_loop_option_on_the_command_line_and_its_errors():
    parser = cli.build_parser()
    ns = parser.parse_args(["generate", "--decode-loop", "python", "hi"])
    assert cli.engine_args_from(ns).decode_loop == "python"
    with pytest.raises(ValueError, match="decode_loop must be one of native, python"):
        EngineArgs(decode_loop="graph")


def test_final_hidden_states_are_bit_identical(smollm):
    """One decode step straight through the model and through the loop, same cache contents."""
    engine = make_engine(smollm, "native")
    loop = engine.runner.decode_loop
    assert loop is not None
    caches = engine.runner.kv_caches
    assert caches is not None
    prompt = torch.arange(100, 140)
    prefill = AttentionMetadata.build([40], [40], [list(range(3))], 16, list(range(40)))
    decode = AttentionMetadata.build([1], [41], [list(range(3))], 16, [40])
    with torch.inference_mode():
        smollm.model(prompt, torch.arange(40), caches, prefill)
        token, position = torch.tensor([7]), torch.tensor([40])
        expected = smollm.model(token, position, caches, decode)
        assert torch.equal(loop(token, position, decode), expected)
