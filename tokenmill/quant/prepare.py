"""The copies of a model's weights its kernels read, laid out once at engine start."""

from __future__ import annotations

from torch import nn

from tokenmill.model.layers import prepack_linears
from tokenmill.quant.linear import prepare_quant_linears


def prepare_weights(model: nn.Module, batch_hint: int | None) -> None:
    """Made before the first request so none pays for them: float weights laid out for about
    `batch_hint` rows (None keeps only the plain weights), quantized linears' panels."""
    prepack_linears(model, batch_hint)
    prepare_quant_linears(model)
