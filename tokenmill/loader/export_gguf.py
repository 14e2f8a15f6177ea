"""`tokenmill quantize --method gguf-q4_k_m | gguf-q5_k_m | gguf-q6_k`: a GGUF model rewritten
with its weights rounded into k-quant blocks (tokenmill.quant.gguf_blocks), metadata and
tokenizer copied.

The source must be a GGUF file (of any types: each tensor is dequantized to fp32, then
rounded); a Hugging Face directory would need llama.cpp's converter's naming and vocabulary
rules first. 1-D tensors (norms) are copied as they are.
"""

from __future__ import annotations

from pathlib import Path

import gguf

from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.resolve import resolve_model
from tokenmill.quant.gguf_blocks import FILE_TYPES, quantize_blocks, tensor_type

GGUF_MIX_METHODS = {f"gguf-{mix}": mix for mix in FILE_TYPES}
FILE_TYPE_KEY = "general.file_type"


def export_gguf(model: str, out: Path, mix: str) -> Path:
    """Write `model` (a .gguf path or packaged name) to the file `out` as a `mix` GGUF."""
    path = resolve_model(model)
    if path.is_dir():
        raise ModelLoadError(
            f"{path}: a k-quant GGUF is written from a .gguf model; convert a Hugging Face "
            "directory with llama.cpp's convert_hf_to_gguf.py first"
        )
    source = GGUFFile(path)
    layers = int(source.arch_value("block_count"))
    writer = gguf.GGUFWriter(out, source.architecture)
    _copy_metadata(gguf.GGUFReader(path), writer)
    writer.add_uint32(FILE_TYPE_KEY, FILE_TYPES[mix])
    for info in source.tensor_infos:
        weight = source.dequantize(info)
        qtype = tensor_type(mix, info.name, info.shape, layers)
        if qtype is None:
            writer.add_tensor(info.name, weight.numpy())
        else:
            blocks = quantize_blocks(weight.reshape(-1, info.shape[-1]), qtype)
            writer.add_tensor(info.name, blocks.reshape(*info.shape[:-1], -1), raw_dtype=qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    """Every key-value field but those the writer makes itself (architecture, GGUF.*) and the
    file type, which the new file sets."""
    for field in reader.fields.values():
        if field.name in (gguf.Keys.General.ARCHITECTURE, FILE_TYPE_KEY) or field.name.startswith(
            "GGUF."
        ):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub_type)
