"""Each quantization method through the load-time hook, on the real SmolLM2, and bad options."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tokenmill.config import QUANTIZATION_METHODS, EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.kernels import ops
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.linear import QuantLinear
from tokenmill.quant.registry import check_quantization, quant_method, quantization_choices
from tokenmill.sampling.params import SamplingParams

from ..engine.test_kv_cache_dtype import count_near_tie_flips

METHODS = ["int8", "int4", "gguf"]
# Mean KL(fp32 || quantized) of next-token distributions over a short text. int8's is the
# issue's target; the "fp32" model is the Q4_1 file dequantized, which int4 in groups of 32 and
# gguf reproduce almost exactly, so theirs is mostly the int8 rounding of activations.
KL_BOUNDS = {"int8": 0.01, "int4": 0.02, "gguf": 0.01}
GREEDY_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]
# int4 and gguf products round activations to 8 bits, so a last-bit difference between native
# and torch arithmetic can move an activation across a rounding step: the two runs' logprobs
# differ by hundredths of a nat (0.036 at the first token of GREEDY_PROMPTS[0] on one machine; int8
# weights, whose activations keep 16 bits, 0.0001). A greedy token may flip only where the native
# run had the two tokens this close (the flip measured there: 0.0033 apart).
NATIVE_NEAR_TIE_NATS = 0.05


def next_token_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        return loaded.model.compute_logits(hidden)


def greedy_output(loaded: LoadedModel, prompt: str, max_tokens: int) -> RequestOutput:
    """The greedy run of `prompt`, with each token's top two logprobs."""
    engine = LLMEngine(EngineArgs(kv_cache_memory="32MiB"), loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
    return outputs[0]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_model_answers_paris(quantized_smollm, method: str) -> None:
    loaded = quantized_smollm(method)
    assert any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    ids = loaded.tokenizer.encode("The capital of France is")
    assert loaded.tokenizer.decode([int(next_token_logits(loaded, ids)[-1].argmax())]) == " Paris"


@pytest.mark.parametrize("method", METHODS)
def test_next_token_distributions_stay_close_to_fp32(
    smollm, quantized_smollm, long_text: str, method: str
) -> None:
    ids = smollm.tokenizer.encode(long_text)
    width = ops.QUANT_KERNEL_MAX_ROWS  # windows this short run on the decode kernels
    kls = []
    for start in range(0, 4 * width, width):
        window = ids[start : start + width]
        reference = F.log_softmax(next_token_logits(smollm, window), dim=-1)
        quantized = F.log_softmax(next_token_logits(quantized_smollm(method), window), dim=-1)
        kls.append((reference.exp() * (reference - quantized)).sum(dim=-1).mean().item())
    assert sum(kls) / len(kls) < KL_BOUNDS[method]


@pytest.mark.parametrize("method", METHODS)
def test_native_and_torch_kernels_give_the_same_greedy_tokens_but_at_near_ties(
    quantized_smollm, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    loaded = quantized_smollm(method)
    native = [greedy_output(loaded, prompt, 8) for prompt in GREEDY_PROMPTS]
    monkeypatch.setattr(ops, "_NATIVE", None)  # what a missing extension leaves
    reference = [greedy_output(loaded, prompt, 8) for prompt in GREEDY_PROMPTS]
    count_near_tie_flips(native, reference, NATIVE_NEAR_TIE_NATS)


def test_quantized_linears_are_smaller(smollm, quantized_smollm) -> None:
    def linear_bytes(loaded: LoadedModel) -> int:
        return sum(p.nbytes for n, p in loaded.model.named_parameters() if "proj" in n)

    fp32 = linear_bytes(smollm)
    assert linear_bytes(quantized_smollm("int8")) < 0.26 * fp32
    assert linear_bytes(quantized_smollm("int4")) < 0.16 * fp32


@pytest.mark.parametrize("name", ["int3", "", "INT8", None])
def test_unknown_methods_are_refused_naming_the_field(name: object) -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, gguf"):
        check_quantization(name)
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineArgs(quantization=name)  # type: ignore[arg-type]


def test_bad_method_options_are_refused() -> None:
    with pytest.raises(ValueError, match="group_size"):
        quant_method("int4", group_size=48)
    with pytest.raises(ValueError, match="bits must be 4"):
        quant_method("int4", bits=8)
    with pytest.raises(ValueError, match="'gguf' takes no option group_size"):
        quant_method("gguf", group_size=32)


def test_registry_names_are_the_ones_config_checks() -> None:
    """config checks `EngineArgs.quantization` against its own tuple without importing quant
    (config imports nothing of tokenmill), so the two lists must stay one."""
    assert quantization_choices() == QUANTIZATION_METHODS
