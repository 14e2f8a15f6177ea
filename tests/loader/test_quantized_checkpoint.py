"""Quantized checkpoints reload as they were saved, and foreign ones are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenmill import cli
from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.loader.quantized_checkpoint import save_quantized
from tokenmill.model.attention import AttentionMetadata
from tokenmill.quant.int4 import Int4Linear, Int4Method
from tokenmill.quant.int8 import Int8Linear

PROMPT = "The capital of France is"


def logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        return loaded.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def int4_at_load(smollm_path: Path) -> LoadedModel:
    return load_model(str(smollm_path), torch.float32, Int4Method(group_size=64))


@pytest.fixture(scope="module")
def int4_checkpoint(int4_at_load: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quantized") / "smollm2-int4-g64"
    return save_quantized(int4_at_load, Int4Method(group_size=64), out)


def test_checkpoint_reloads_to_identical_outputs(
    int4_at_load: LoadedModel, int4_checkpoint: Path
) -> None:
    at_load = int4_at_load
    reloaded = load_model(str(int4_checkpoint))
    ids = at_load.tokenizer.encode(PROMPT)
    assert reloaded.tokenizer.encode(PROMPT) == ids
    assert torch.equal(logits(reloaded, ids), logits(at_load, ids))


def test_checkpoint_keeps_each_layers_format(int4_checkpoint: Path) -> None:
    model = load_model(str(int4_checkpoint), torch.float32, "int4").model
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.group_size == 64
    assert isinstance(model.lm_head, Int8Linear)
    saved = json.loads((int4_checkpoint / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "int4" and saved["group_size"] == 64


def test_checkpoint_refuses_another_method(int4_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="already quantized with 'int4'"):
        load_model(str(int4_checkpoint), torch.float32, "int8")


def test_other_tools_quantized_checkpoints_are_refused(
    int4_checkpoint: Path, tmp_path: Path
) -> None:
    foreign = tmp_path / "gptq-from-elsewhere"
    shutil.copytree(int4_checkpoint, foreign)
    config = json.loads((foreign / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (foreign / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="another tool"):
        load_model(str(foreign))


def test_quantize_command_reports_bad_options(smollm_path: Path, tmp_path: Path, capsys) -> None:
    argv = ["quantize", "--method", "int8", "--bits", "4", str(smollm_path), str(tmp_path)]
    assert cli.main(argv) == 2
    assert "bits must be 8" in capsys.readouterr().err
