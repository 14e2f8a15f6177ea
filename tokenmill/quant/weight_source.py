"""What the loader hands a quantization method: the weights it found (`WeightSource`), and the
interfaces of the two things in it that the loader reads but quant uses, a GGUF file's blocks and
a tokenizer. The loader implements these; quant never imports the loader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from gguf import GGMLQuantizationType

from tokenmill.config import ModelConfig


class TextEncoder(Protocol):
    """A tokenizer, as far as calibrating on text needs one (tokenmill.loader's `Tokenizer`)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


class GGUFTensor(Protocol):
    """One tensor of a GGUF file, as stored: its block type and torch-order shape."""

    @property
    def qtype(self) -> GGMLQuantizationType: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


# Makes one GGUF tensor (given its Hugging Face name) into one or more named tensors.
GGUFTensorReader = Callable[[str, GGUFTensor], dict[str, torch.Tensor]]


class GGUFBlocks(Protocol):
    """A GGUF model file's tensors under their Hugging Face names, for methods that keep its
    blocks (tokenmill.loader.gguf_model.GGUFModelBlocks)."""

    def tensors(self) -> Iterator[tuple[str, GGUFTensor]]:
        """(Hugging Face name, tensor) for every tensor of the file, in file order."""
        ...

    def raw_bytes(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes exactly as stored."""
        ...

    def dequantize(self, tensor: GGUFTensor) -> torch.Tensor:
        """The tensor as floats of the model's dtype."""
        ...

    def weights(self, read: GGUFTensorReader) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's weights, each tensor made by `read` and then given the loader's row
        fixes (the rows of packed tensors are the weight's rows, so the fixes apply)."""
        ...


@dataclass
class WeightSource:
    """A model's weights as the loader found them."""

    config: ModelConfig
    dtype: torch.dtype
    weights: Iterator[tuple[str, torch.Tensor]]  # Hugging Face names, float, read lazily
    gguf: GGUFBlocks | None = None  # the file's blocks, when the model is a GGUF file
    saved_quantization: dict[str, Any] | None = None  # a tokenmill checkpoint's own record
    tokenizer: TextEncoder | None = None  # for methods that calibrate on text (GPTQ, AWQ, ...)
