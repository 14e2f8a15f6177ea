"""The one interface every quantized linear layer shares, and the swap that installs them.

A model is built with float `Linear` layers; quantization replaces some of them, at load time,
with a `QuantLinear` of the same shape. The model calls `layer(x)` either way and never learns
which kind it holds. Packed tensors are frozen parameters whose first dimension is the output
row, so the model's own loader copies checkpoints into them, merged q/k/v rows included.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenmill.kernels import ops
from tokenmill.model.layers import Linear

# Inputs per quantization block: every group size is a multiple of it.
QUANT_BLOCK = 32
# The output projection's module name in every tokenmill model.
LM_HEAD = "lm_head"
# Output rows quantized per step at load time, bounding the fp32 temporaries.
QUANTIZE_CHUNK_ROWS = 4096


def check_group_size(group_size: object) -> int:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive multiple of 32, got {group_size!r}")
    if group_size % QUANT_BLOCK:
        raise ValueError(f"group_size must be a multiple of 32 (32, 64, 128), got {group_size}")
    return group_size


def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    """A parameter that holds data, not gradients: integer tensors can only be these."""
    return nn.Parameter(tensor, requires_grad=False)


class QuantLinear(nn.Module, ABC):
    """y = x W^T + b with W stored in a low-bit format; `forward(x)` is all a model sees."""

    # The format's name in checkpoints and `QUANT_LINEARS` ("int8", "int4", ...).
    kind: str

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = frozen(torch.zeros(out_features)) if bias else None

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    def native_kernel(self) -> object | None:
        """The packed weights bound to their skinny kernel, for the native decode loop; None
        for a format that has no such kernel (the step then runs layer by layer in Python)."""
        return None

    def prepare(self) -> None:
        """Makes the copies its kernels read (int8 / int4 panels) ahead of the first product,
        which would otherwise pay for them: the engine calls it at start. Formats whose kernels
        read the stored tensors have nothing to make."""

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out_features, in_features] the packed tensors stand for."""

    @abstractmethod
    def format(self) -> dict[str, Any]:
        """`{"kind": ..., **options}`: enough for `empty_quant_linear` to rebuild the layer."""

    def extra_repr(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.format().items() if k != "kind")
        return f"in_features={self.in_features}, out_features={self.out_features}, {options}"


class DerivedCache:
    """Something a layer derives from its row-major tensors (a kernel's copy of the weight, row
    sums), made on first use and again whenever those tensors change (a checkpoint loaded into
    them, a copy of the layer). Not a parameter: checkpoints hold only the row-major form."""

    def __init__(self) -> None:
        self._value: Any = None
        self._source: tuple[tuple[int, int], ...] | None = None

    def get(self, tensors: tuple[torch.Tensor, ...], make: Callable[[], Any]) -> Any:
        """What `make()` derives from `tensors`, remade when any of them changed."""
        # Tensors made under inference_mode have no version counter: those count as unchanged.
        source = tuple((t.data_ptr(), -1 if t.is_inference() else t._version) for t in tensors)
        if source != self._source:
            with torch.no_grad():
                self._value = make()
            self._source = source
        return self._value


class PanelCache(DerivedCache):
    """A quantized layer's weight regrouped for the native kernels (`ops.QuantPanels`), which the
    reference path and the wide products never read."""

    def get(
        self, tensors: tuple[torch.Tensor, ...], pack: Callable[[], ops.QuantPanels]
    ) -> ops.QuantPanels | None:
        """The panels `pack()` makes of `tensors`; None under torch's kernels, which never read
        them."""
        if ops.backend() != "native":
            return None
        return super().get(tensors, pack)


class PanelQuantLinear(QuantLinear):
    """A format stored in groups of `group_size` inputs whose native kernels read panels made
    from its row-major tensors (int8, int4); `prepare` makes them."""

    group_size: int | None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias)
        self._panels = PanelCache()

    @abstractmethod
    def panels(self) -> ops.QuantPanels | None:
        """The layer's panels, made or remade as `PanelCache.get` decides."""

    def prepare(self) -> None:
        self.panels()

    def format(self) -> dict[str, Any]:
        return {"kind": self.kind, "group_size": self.group_size}


def prepare_quant_linears(model: nn.Module) -> None:
    """`QuantLinear.prepare` on every quantized layer of the model, so the first request does
    not pay for packing the panels (a large LM head's most of all) in its time to first token."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare()


# Kind -> class; each format module registers itself when imported (tokenmill.quant.registry
# imports them all).
QUANT_LINEARS: dict[str, type[QuantLinear]] = {}


def register_quant_linear(cls: type[QuantLinear]) -> type[QuantLinear]:
    QUANT_LINEARS[cls.kind] = cls
    return cls


def empty_quant_linear(fmt: dict[str, Any], like: Linear) -> QuantLinear:
    """A zero-filled QuantLinear of `fmt` with `like`'s shape, for a checkpoint to load into."""
    options = dict(fmt)
    kind = options.pop("kind", None)
    if kind not in QUANT_LINEARS:
        raise ValueError(
            f"quantized layer kind {kind!r} is unknown; known: {', '.join(sorted(QUANT_LINEARS))}"
        )
    return QUANT_LINEARS[kind](
        like.in_features, like.out_features, like.bias is not None, **options
    )


def replace_linears(model: nn.Module, make: Callable[[str, Linear], nn.Module | None]) -> None:
    """Swap each float `Linear` for `make(name, linear)` (kept when that returns None). The old
    module is dropped, so its fp32 weight is freed unless something else holds it (a tied
    embedding does)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            replacement = make(name, module)
            if replacement is not None:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, replacement)


def quant_linear_formats(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Module name -> format of every quantized linear in `model`."""
    return {
        name: module.format()
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear)
    }
