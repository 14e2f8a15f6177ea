"""`export_gguf`: a GGUF rewritten as a k-quant mix reloads with the same tensors, each holding
exactly the blocks the encoder makes of the source's weights, and the same metadata."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tokenmill import cli
from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.export_gguf import FILE_TYPE_KEY, export_gguf
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.quant.gguf_blocks import FILE_TYPES, quantize_blocks, tensor_type

SOURCE_TENSORS = {
    "token_embd.weight": (96, 256),
    "blk.0.attn_v.weight": (32, 256),
    "blk.0.attn_q.weight": (64, 320),  # not whole super-blocks: the fallback types
    "blk.0.attn_norm.weight": (256,),
    "blk.1.ffn_down.weight": (256, 512),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small float GGUF with a Llama file's names and metadata."""
    path = tmp_path_factory.mktemp("source") / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(256)
    writer.add_token_list([f"t{i}" for i in range(96)])
    rng = np.random.default_rng(0)
    for name, shape in SOURCE_TENSORS.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("mix", sorted(FILE_TYPES))
def test_written_file_reloads_with_the_encoders_blocks(source: Path, tmp_path: Path, mix) -> None:
    out = export_gguf(str(source), tmp_path / "out.gguf", mix)
    original, written = GGUFFile(source), GGUFFile(out)
    assert [(i.name, i.shape) for i in written.tensor_infos] == [
        (i.name, i.shape) for i in original.tensor_infos
    ]
    for before, after in zip(original.tensor_infos, written.tensor_infos, strict=True):
        weight = original.dequantize(before)
        qtype = tensor_type(mix, before.name, before.shape, num_layers=2)
        if qtype is None:
            assert torch.equal(written.dequantize(after), weight)
            continue
        assert after.qtype == qtype
        expected = quantize_blocks(weight.reshape(-1, before.shape[-1]), qtype)
        assert np.array_equal(written.raw_bytes(after), expected.reshape(-1))


def test_metadata_is_copied_and_the_file_type_set(source: Path, tmp_path: Path) -> None:
    out = export_gguf(str(source), tmp_path / "out.gguf", "q4_k_m")
    original, written = GGUFFile(source).metadata, GGUFFile(out).metadata
    assert written[FILE_TYPE_KEY] == FILE_TYPES["q4_k_m"]
    assert {k: v for k, v in written.items() if k != FILE_TYPE_KEY} == original


def test_quantize_command_writes_the_mix(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.gguf"
    assert cli.main(["quantize", "--method", "gguf-q6_k", str(source), str(out)]) == 0
    assert GGUFFile(out).metadata[FILE_TYPE_KEY] == FILE_TYPES["q6_k"]


def test_a_hugging_face_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="convert_hf_to_gguf"):
        export_gguf(str(tmp_path), tmp_path / "out.gguf", "q4_k_m")
