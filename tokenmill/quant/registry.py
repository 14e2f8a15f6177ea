"""Quantization methods by name, and the one load-time hook that applies the chosen one.

A new method is a `QuantMethod` subclass in its own module plus one entry in `QUANT_METHODS`;
`--quantization`, `EngineArgs.quantization` and `tokenmill quantize` pick it up from here.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from tokenmill.quant.awq import AWQMethod
from tokenmill.quant.checkpoint import SavedQuantization
from tokenmill.quant.fp8 import Fp8Method
from tokenmill.quant.gguf import GGUFMethod
from tokenmill.quant.gptq import GPTQMethod
from tokenmill.quant.int4 import Int4Method
from tokenmill.quant.int8 import Int8Method
from tokenmill.quant.method import NoQuantization, QuantMethod
from tokenmill.quant.nf4 import Nf4Method
from tokenmill.quant.smoothquant import SmoothQuantMethod
from tokenmill.quant.weight_source import WeightSource

NO_QUANTIZATION = NoQuantization.name
QUANT_METHODS: dict[str, type[QuantMethod]] = {
    Int8Method.name: Int8Method,
    Int4Method.name: Int4Method,
    GGUFMethod.name: GGUFMethod,
    GPTQMethod.name: GPTQMethod,
    AWQMethod.name: AWQMethod,
    SmoothQuantMethod.name: SmoothQuantMethod,
    Fp8Method.name: Fp8Method,
    Nf4Method.name: Nf4Method,
}


def quantization_choices() -> tuple[str, ...]:
    return (NO_QUANTIZATION, *QUANT_METHODS)


def check_quantization(name: object, field: str = "quantization") -> None:
    if name not in quantization_choices():
        raise ValueError(
            f"{field} must be one of {', '.join(quantization_choices())}, got {name!r}"
        )


def quant_method(name: str, **options: Any) -> QuantMethod:
    """The method called `name`, with its options (group_size=..., bits=...) checked."""
    check_quantization(name)
    method = NoQuantization if name == NO_QUANTIZATION else QUANT_METHODS[name]
    try:
        inspect.signature(method).bind(**options)
    except TypeError:
        raise ValueError(
            f"quantization {name!r} takes no option {', '.join(sorted(options))}"
        ) from None
    return method(**options)


def load_model_weights(
    model: nn.Module, quantization: str | QuantMethod, source: WeightSource
) -> None:
    """The load-time hook: fill a freshly built `model` from `source`, quantized as
    `quantization` (a name or a configured method) asks, or as the checkpoint already is
    (asking for another method than a checkpoint's own is an error)."""
    method = quantization if isinstance(quantization, QuantMethod) else quant_method(quantization)
    saved = source.saved_quantization
    if saved is None:
        method.load(model, source)
        return
    if method.name not in (NO_QUANTIZATION, saved["quant_method"]):
        raise ValueError(
            f"quantization={method.name!r}, but this checkpoint is already quantized with "
            f"{saved['quant_method']!r}; load it with quantization='none' or "
            f"{saved['quant_method']!r}"
        )
    SavedQuantization(saved).load(model, source)
