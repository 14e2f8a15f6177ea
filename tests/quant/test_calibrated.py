"""GPTQ, AWQ and SmoothQuant through the load path, on the real SmolLM2 with a little
calibration text: greedy answers, closeness to fp32, checkpoints, clear errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tokenmill import cli
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.loader.quantized_checkpoint import save_quantized
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant import awq
from tokenmill.quant.groupwise import CALIBRATED_GROUP_SIZE
from tokenmill.quant.int4 import Int4Linear
from tokenmill.quant.registry import quant_method
from tokenmill.quant.smoothquant import SmoothQuantLinear
from tokenmill.quant.weight_source import WeightSource

# Enough to show each method working, and quickly; the defaults (64 x 512 tokens) do better.
SMALL_CALIBRATION = {"calib_samples": 4, "calib_seq_len": 128}
METHODS = {
    "gptq": {"act_order": True},
    "awq": {},
    "smoothquant": {},
}


@pytest.fixture(scope="module")
def calibrated(smollm_path: Path) -> Callable[[str], LoadedModel]:
    cache: dict[str, LoadedModel] = {}

    def load(name: str) -> LoadedModel:
        if name not in cache:
            options = {**METHODS.get(name, {}), **SMALL_CALIBRATION}
            if name == "int4":  # round-to-nearest at the calibrated methods' group size
                options = {"group_size": CALIBRATED_GROUP_SIZE}
            with pytest.MonkeyPatch.context() as patch:
                # AWQ's time goes into its 21 candidate factors per linear; 5 keep the test
                # short and still include s = 1, so it cannot end up worse than rounding.
                patch.setattr(awq, "SCALE_GRID", 4)
                method = quant_method(name, **options)
                cache[name] = load_model(str(smollm_path), torch.float32, method)
        return cache[name]

    return load


def log_probs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        return F.log_softmax(loaded.model.compute_logits(hidden), dim=-1)


def mean_kl(reference: LoadedModel, quantized: LoadedModel, ids: list[int]) -> float:
    ref, ours = log_probs(reference, ids), log_probs(quantized, ids)
    return (ref.exp() * (ref - ours)).sum(dim=-1).mean().item()


@pytest.mark.parametrize("name", METHODS)
def test_answers_paris_greedily(calibrated, name: str) -> None:
    loaded = calibrated(name)
    ids = loaded.tokenizer.encode("The capital of France is")
    assert loaded.tokenizer.decode([int(log_probs(loaded, ids)[-1].argmax())]) == " Paris"


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_int4_methods_beat_round_to_nearest(smollm, calibrated, long_text, name: str) -> None:
    assert isinstance(calibrated(name).model.layers[0].mlp.down_proj, Int4Linear)
    ids = smollm.tokenizer.encode(long_text)[:256]
    assert mean_kl(smollm, calibrated(name), ids) < 0.8 * mean_kl(smollm, calibrated("int4"), ids)


def test_smoothquant_stays_close_to_fp32(smollm, calibrated, long_text) -> None:
    loaded = calibrated("smoothquant")
    assert isinstance(loaded.model.layers[0].self_attn.qkv_proj, SmoothQuantLinear)
    assert mean_kl(smollm, loaded, smollm.tokenizer.encode(long_text)[:256]) < 0.05


@pytest.mark.parametrize("name", METHODS)
def test_checkpoint_reloads_to_identical_outputs(calibrated, tmp_path: Path, name: str) -> None:
    loaded = calibrated(name)
    out = save_quantized(loaded, quant_method(name, **METHODS[name]), tmp_path / name)
    reloaded = load_model(str(out), torch.float32, name)
    ids = loaded.tokenizer.encode("The capital of France is a city")
    for rows in (ids[:3], ids * 6):  # decode-sized and wide products take different paths
        assert torch.equal(log_probs(reloaded, rows), log_probs(loaded, rows))


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("gptq", {"damp_percent": 0.0}, "damp_percent"),
        ("gptq", {"act_order": "yes"}, "act_order"),
        ("gptq", {"group_size": 100}, "group_size"),
        ("awq", {"bits": 3}, "bits must be 4"),
        ("awq", {"alpha": 0.5}, "'awq' takes no option alpha"),
        ("smoothquant", {"alpha": 1.5}, "alpha"),
        ("smoothquant", {"calib_samples": 0}, "calib_samples"),
        ("int4", {"act_order": True}, "'int4' takes no option act_order"),
    ],
)
def test_bad_options_are_clear_errors(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quant_method(name, **options)


def test_calibration_needs_a_tokenizer_and_a_supported_architecture(smollm) -> None:
    method = quant_method("gptq")
    source = WeightSource(smollm.config, torch.float32, iter(()))
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        method.load(smollm.model, source)
    gemma = WeightSource(
        smollm.config.__class__(**{**smollm.config.__dict__, "architecture": "Gemma3ForCausalLM"}),
        torch.float32,
        iter(()),
        tokenizer=smollm.tokenizer,
    )
    with pytest.raises(ValueError, match="supports LlamaForCausalLM"):
        method.load(smollm.model, gemma)


def test_quantize_command_passes_calibration_options(smollm_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "w8a8"
    argv = ["quantize", "--method", "smoothquant", "--calib-samples", "2", "--alpha", "0.6"]
    assert cli.main([*argv, str(smollm_path), str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "smoothquant"
    assert (saved["calib_samples"], saved["alpha"]) == (2, 0.6)


def test_quantize_command_refuses_options_of_other_methods(smollm_path, tmp_path, capsys) -> None:
    argv = ["quantize", "--method", "int4", "--act-order", str(smollm_path), str(tmp_path / "x")]
    assert cli.main(argv) == 2
    assert "'int4' takes no option act_order" in capsys.readouterr().err
