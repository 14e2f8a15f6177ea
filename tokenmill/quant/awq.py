"""AWQ (Lin et al., 2023): activation-aware int4. A few input channels carry much larger
activations than the rest, and rounding errors in the weights they meet dominate the output
error. Scaling those weight columns up by s (and the activations down by s, folded into the
op that produces them) gives them finer steps on the int4 grid. s = mean|x|^alpha /
mean|w|^(1 - alpha) per input channel (AutoAWQ's "duo" form), with alpha chosen on a grid in
[0, 1) to minimise the quantized product's output error on calibration inputs; s = 1, plain
round-to-nearest, is a candidate too, so the search can only help on what it sees. A second
search then shrinks each group's range where clipping a few extreme weights lowers the output
error. Weights end as the same group-wise int4 as round-to-nearest.

Errors are measured through the Gram matrix G = X^T X of all calibration inputs, since
||X D^T||^2 = sum_n D_n G D_n^T for a weight error D: every calibration token counts, at the
cost of one K x K matrix per linear instead of a forward pass per candidate. One
simplification against the reference implementation: the error is that of each linear's own
output, not of its whole attention or MLP block. One change: each layer learns from the outputs
of the already quantized layers before it, as GPTQ does, so its factors answer the inputs it
will really see (the reference passes float outputs on; this measured better on SmolLM2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.quant.calibrated import CalibratedInt4Method
from tokenmill.quant.gptq import HessianAccumulator
from tokenmill.quant.groupwise import (
    Int4Codes,
    grouped,
    output_error,
    quantize_clipped,
    search_clip,
)
from tokenmill.quant.layerwise import LAYER_LINEARS, LayerInputs, replace_module
from tokenmill.quant.smoothing import llama_migrations

SCALE_GRID = 20


class ActivationStats(HessianAccumulator):
    """Everything AWQ needs of a linear's inputs: their Gram matrix and mean |x| per channel."""

    def __init__(self, in_features: int) -> None:
        super().__init__(in_features)
        self.abs_sum = torch.zeros(in_features, dtype=torch.float64)

    def add(self, x: torch.Tensor) -> None:
        super().add(x)
        self.abs_sum += x.abs().sum(dim=0).double()

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(self.rows, 1)).float()

    def gram(self) -> torch.Tensor:
        return (self.sum / max(self.rows, 1)).float()


def search_scales(
    weight: torch.Tensor,
    gram: torch.Tensor,
    mean_abs: torch.Tensor,
    weight_mean: torch.Tensor,
    group_size: int,
    expand: Callable[[torch.Tensor], torch.Tensor] = lambda s: s,
) -> torch.Tensor:
    """The factor s whose rounding Q(W s) / s of `weight` [N, K] changes the outputs least for
    inputs of Gram matrix `gram` [K, K]: s = 1 (plain rounding) or, for alpha on the grid,
    s = mean|x|^alpha / mean|w|^(1 - alpha) (AutoAWQ's "duo" scaling). `mean_abs` and
    `weight_mean` (|w| relative to its group's largest, averaged over rows) are given per
    channel of the op producing the inputs; `expand` maps those channels onto the K inputs
    when they differ (grouped-query attention)."""
    best_error, best = float("inf"), torch.ones_like(mean_abs)
    for step in range(-1, SCALE_GRID):
        if step < 0:
            scales = torch.ones_like(mean_abs)
        else:
            alpha = step / SCALE_GRID
            scales = mean_abs.pow(alpha) / (weight_mean.pow(1 - alpha) + 1e-4)
            scales = scales.clamp(min=1e-4)
            scales = scales / (scales.max() * scales.min()).sqrt()  # centred, for fp range
        columns = expand(scales)
        quantized = Int4Codes.round_to_nearest(weight * columns, group_size).dequantize()
        error = output_error(quantized / columns - weight, gram).item()
        if error < best_error:
            best_error, best = error, scales
    return best


def relative_weight_magnitude(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per input channel, the mean over rows of |w| divided by its group's largest |w|."""
    magnitude = grouped(weight.abs(), group_size)
    relative = magnitude / magnitude.amax(dim=-1, keepdim=True).clamp(min=1e-6)
    return relative.view(weight.shape[0], -1)[:, : weight.shape[1]].mean(dim=0)


def awq_model(model: nn.Module, samples: torch.Tensor, group_size: int) -> None:
    """Scale, clip and round every decoder-layer linear of `model` to int4, in place; the
    factors fold into the norms and the linears that produce each linear's inputs."""
    # Under grouped-query attention a value row feeds several heads' output columns, which
    # must then share one factor; the reference skips that pair, and it measured worse here.
    migrations = [m for m in llama_migrations(model.config) if m.fan_out == 1]
    inputs = LayerInputs(model, samples)
    for layer in model.layers:
        stats = {
            name: ActivationStats(layer.get_submodule(name).in_features) for name in LAYER_LINEARS
        }
        inputs.run(layer, {name: s.add for name, s in stats.items()})
        grams = {name: s.gram() for name, s in stats.items()}
        with torch.no_grad():
            for m in migrations:
                weight = layer.get_submodule(m.linear).weight
                mean_abs = m.reduce(stats[m.linear].mean_abs())
                weight_mean = m.reduce(relative_weight_magnitude(weight, group_size))
                scales = search_scales(
                    weight, grams[m.linear], mean_abs, weight_mean, group_size, m.expand
                )
                m.apply(layer, scales)
                columns = m.expand(scales)
                grams[m.linear] /= columns[:, None] * columns[None, :]  # the inputs are x / s
            for name in LAYER_LINEARS:
                linear = layer.get_submodule(name)
                clip = search_clip(linear.weight, grams[name], group_size)
                codes = quantize_clipped(linear.weight, clip, group_size)
                replace_module(layer, name, codes.to_linear(linear.bias))
        inputs.advance(layer)


class AWQMethod(CalibratedInt4Method):
    """Every decoder-layer linear AWQ-scaled, clipped and rounded to int4 at load time; the LM
    head as the int4 method keeps it."""

    name = "awq"

    def quantize_layers(self, model: nn.Module, samples: torch.Tensor) -> None:
        awq_model(model, samples, self.group_size)
