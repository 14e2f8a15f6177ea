"""What a quantization method is to the loader: something that fills a freshly built model from
its weights and leaves the linears it quantizes as QuantLinears.

Most methods start from the float weights: the model loads them, then each float `Linear` is
replaced by its quantized form (the old fp32 weight is freed with it). Methods that need the
whole model first (calibration) override `load`; formats read straight from the file (GGUF
blocks, a saved checkpoint) install empty QuantLinears before loading into them.
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

from torch import nn

from tokenmill.model.layers import Linear
from tokenmill.quant.linear import replace_linears
from tokenmill.quant.weight_source import WeightSource


class QuantMethod(ABC):
    """One way of storing a model's linear weights, chosen by name at load time."""

    name: ClassVar[str]

    def load(self, model: nn.Module, source: WeightSource) -> None:
        """Fill `model` from `source`: float weights first, then every linear is quantized."""
        model.load_weights(source.weights)
        replace_linears(model, self.quantize_linear)

    def quantize_linear(self, name: str, linear: Linear) -> nn.Module | None:
        """The replacement for one loaded float linear; None keeps it float."""
        raise NotImplementedError(f"{type(self).__name__} does not quantize float linears")

    def options(self) -> dict[str, Any]:
        """The method's settings, as a saved checkpoint records them."""
        return {}


def check_bits(method: str, bits: object, supported: tuple[int, ...]) -> int:
    if bits not in supported or isinstance(bits, bool):
        allowed = ", ".join(map(str, supported))
        raise ValueError(f"bits must be {allowed} for quantization {method!r}, got {bits!r}")
    return int(bits)  # type: ignore[call-overload]


class NoQuantization(QuantMethod):
    name = "none"

    def load(self, model: nn.Module, source: WeightSource) -> None:
        model.load_weights(source.weights)
