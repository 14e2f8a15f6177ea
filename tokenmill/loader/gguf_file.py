"""Read a GGUF file: its metadata as plain Python values and its tensors as torch tensors.

The header is parsed here with one memory map rather than with `gguf.GGUFReader`, which builds a
numpy view per array element, slow on a 262k-token vocabulary; the `gguf` package
still supplies the type tables, and tokenmill.loader.dequant unpacks the blocks in torch. A
missing, truncated or foreign file becomes a `ModelLoadError` naming the path and the expectation.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tokenmill.loader.dequant import dequantize as dequantize_blocks
from tokenmill.loader.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# The types the two reference models use, plus the plain float ones every converter writes.
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q6_K,
        # What a `gguf-q5_k_m` file adds (tokenmill.quant.gguf_blocks).
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q5_1,
    }
)

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
    GGUFValueType.BOOL: "<?",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: slowest-varying dimension first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """An opened GGUF file; metadata is read eagerly, tensor data lazily through a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path}: no such file (expected a .gguf model file)")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")
        try:
            self.metadata, self.tensor_infos = _HeaderParser(self._data, self.path).parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError) as exc:
            raise ModelLoadError(
                f"{self.path}: GGUF header could not be read (truncated or corrupt?): {exc}"
            ) from exc
        self.architecture: str = self.metadata.get("general.architecture", "")
        if not self.architecture:
            raise ModelLoadError(f"{self.path}: GGUF metadata has no general.architecture")

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A `{architecture}.{key}` metadata value, such as `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (GGUF name, dequantized tensor in torch's row-major shape)."""
        for info in self.tensor_infos:
            yield info.name, self.dequantize(info).to(dtype)

    def raw_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's bytes exactly as stored, for kernels that read the block format."""
        return self._data[info.offset : info.offset + info.nbytes]

    def dequantize(self, info: TensorInfo) -> torch.Tensor:
        raw = self.raw_bytes(info)
        if info.qtype == GGMLQuantizationType.F32:
            array = raw.view(np.float32)
        elif info.qtype == GGMLQuantizationType.F16:
            array = raw.view(np.float16)
        elif info.qtype == GGMLQuantizationType.BF16:
            bits = raw.view(np.uint16).astype(np.uint32) << 16
            array = bits.view(np.float32)
        else:
            return dequantize_blocks(raw, info.qtype, info.shape)
        return torch.from_numpy(np.array(array, dtype=np.float32)).reshape(info.shape)


@functools.cache
def _struct(fmt: str) -> struct.Struct:
    return struct.Struct(fmt)


def _num_rows(shape: tuple[int, ...]) -> int:
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    return rows


class _HeaderParser:
    """A cursor over the file's header; each read advances it."""

    def __init__(self, data: np.ndarray, path: Path) -> None:
        # A memoryview, not the memmap: slicing a memmap makes a memmap object, and a large
        # vocabulary is hundreds of thousands of strings.
        self.data = memoryview(data).cast("B")
        self.path = path
        self.pos = 0

    def parse(self) -> tuple[dict[str, Any], list[TensorInfo]]:
        magic = bytes(self.data[:4])
        if magic != GGUF_MAGIC:
            raise ModelLoadError(
                f"{self.path}: not a GGUF file (expected the magic bytes 'GGUF', found {magic!r})"
            )
        self.pos = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version}; expected version 2 or 3")
        tensor_count = self._scalar("<Q")
        kv_count = self._scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            metadata[key] = self._value(GGUFValueType(self._scalar("<I")))
        raw_infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-self.pos // alignment) * alignment
        infos = [
            TensorInfo(name, shape, qtype, data_start + offset, _tensor_nbytes(shape, qtype, name))
            for name, shape, qtype, offset in raw_infos
        ]
        for info in infos:
            if info.offset + info.nbytes > len(self.data):
                raise ModelLoadError(
                    f"{self.path}: truncated: tensor {info.name} ends at byte "
                    f"{info.offset + info.nbytes} but the file has {len(self.data)} bytes"
                )
        return metadata, infos

    def _scalar(self, fmt: str) -> Any:
        packing = _struct(fmt)
        if self.pos + packing.size > len(self.data):
            raise ValueError(f"header ends early at byte {self.pos}")
        (value,) = packing.unpack_from(self.data, self.pos)
        self.pos += packing.size
        return value

    def _string(self) -> str:
        return self._strings(1)[0]

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self._scalar("<I"))
            count = self._scalar("<Q")
            if item_type in _SCALAR_FORMATS:
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                end = self.pos + count * dtype.itemsize
                if end > len(self.data):
                    raise ValueError(f"array runs past the end at byte {self.pos}")
                items = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos)
                self.pos = end
                return items.tolist()
            if item_type == GGUFValueType.STRING:
                return self._strings(count)
            return [self._value(item_type) for _ in range(count)]
        return self._scalar(_SCALAR_FORMATS[vtype])

    def _strings(self, count: int) -> list[str]:
        """`count` strings, each its length then its UTF-8 bytes, in one loop: a vocabulary is
        most of a header."""
        data, pos, end = self.data, self.pos, len(self.data)
        unpack_length = _struct("<Q").unpack_from
        strings = []
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError(f"header ends early at byte {pos}")
            (length,) = unpack_length(data, pos)
            pos += 8
            if pos + length > end:
                raise ValueError(f"string of {length} bytes runs past the end at byte {pos}")
            strings.append(str(data[pos : pos + length], "utf-8"))
            pos += length
        self.pos = pos
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        dims = [self._scalar("<Q") for _ in range(n_dims)]
        qtype = GGMLQuantizationType(self._scalar("<I"))
        offset = self._scalar("<Q")
        if qtype not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{self.path}: tensor {name} has type {qtype.name}; supported types are "
                + ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            )
        # GGUF lists dimensions fastest-first; torch wants them slowest-first.
        return name, tuple(reversed(dims)), qtype, offset


def _tensor_nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType, name: str) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    count = _num_rows(shape) * shape[-1]
    if shape[-1] % block_size:
        raise ValueError(f"tensor {name}: row of {shape[-1]} is not a multiple of {block_size}")
    return count // block_size * type_size
