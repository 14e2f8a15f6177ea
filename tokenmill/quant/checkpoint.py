"""A checkpoint `tokenmill quantize` wrote, as quantization sees it: the record of how it was
quantized, and loading its already packed layers.

The record, {"producer": "tokenmill", "quant_method": ..., method options, "modules": {layer
name: format}}, sits in the checkpoint's config.json; tokenmill.loader.quantized_checkpoint
reads and writes the files. Tensors keep the model's own names (merged q/k/v and gate/up) and
the kernels' packed layouts, so loading is a plain copy.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tokenmill.model.layers import Linear
from tokenmill.quant.linear import empty_quant_linear, quant_linear_formats, replace_linears
from tokenmill.quant.method import QuantMethod
from tokenmill.quant.weight_source import WeightSource

PRODUCER = "tokenmill"


def quantization_record(method: QuantMethod, model: nn.Module) -> dict[str, Any]:
    """The record of `model`, quantized by `method`, that loads it back as it is."""
    return {
        "producer": PRODUCER,
        "quant_method": method.name,
        **method.options(),
        "modules": quant_linear_formats(model),
    }


def is_own_record(saved: object) -> bool:
    """Whether `saved` (a checkpoint's quantization config) is a record tokenmill wrote: other
    tools' quantized layouts are not ones tokenmill's kernels run."""
    return isinstance(saved, dict) and saved.get("producer") == PRODUCER


class SavedQuantization(QuantMethod):
    """A checkpoint `tokenmill quantize` wrote: its layers are already packed, so empty
    QuantLinears of the recorded formats go in first and the tensors load straight into them."""

    def __init__(self, saved: dict[str, Any]) -> None:
        self.name = saved["quant_method"]
        self.formats: dict[str, dict[str, Any]] = saved["modules"]

    def load(self, model: nn.Module, source: WeightSource) -> None:
        linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
        unknown = sorted(set(self.formats) - linears)
        if unknown:
            raise ValueError(
                f"quantized checkpoint names layers the model lacks: {', '.join(unknown[:4])}"
            )
        replace_linears(
            model,
            lambda name, linear: (
                empty_quant_linear(self.formats[name], linear) if name in self.formats else None
            ),
        )
        model.load_weights(source.weights)
