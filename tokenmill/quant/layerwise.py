"""Calibration samples through a decoder one layer at a time, the way GPTQ, AWQ and SmoothQuant
look at a model: the layer's linears see their real inputs, the layer is then rewritten, and its
outputs become the next layer's inputs. Only one layer's activations exist at any time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tokenmill.model.attention import AttentionMetadata

# The four products of a Llama-family decoder layer, under the merged names tokenmill uses.
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
# Tokens per forward pass while calibrating: big enough for GEMM speed, small enough for memory.
CHUNK_TOKENS = 2048

InputObserver = Callable[[torch.Tensor], None]


class LayerInputs:
    """The residual stream entering one decoder layer, for every calibration sample at once."""

    def __init__(self, model: nn.Module, samples: torch.Tensor) -> None:
        if samples.dim() != 2 or samples.numel() == 0:
            raise ValueError(
                f"samples must be [num_samples, seq_len] token ids, got {samples.shape}"
            )
        self.seq_len = samples.shape[1]
        self.per_chunk = max(1, CHUNK_TOKENS // self.seq_len)
        with torch.inference_mode():
            self.hidden = model.embed_tokens(samples.reshape(-1)).clone()
        self.residual: torch.Tensor | None = None

    def run(self, layer: nn.Module, observers: dict[str, InputObserver] | None = None) -> None:
        """Run `layer` on the current inputs, handing each named linear's input to its observer;
        the inputs stay as they are."""
        with _observing(layer, observers or {}):
            for _ in self._outputs(layer):
                pass

    def advance(self, layer: nn.Module, observers: dict[str, InputObserver] | None = None) -> None:
        """Run `layer` (observing as `run` does) and make its outputs the current inputs."""
        hidden, residual = torch.empty_like(self.hidden), torch.empty_like(self.hidden)
        with _observing(layer, observers or {}):
            for rows, (out, res) in self._outputs(layer):
                hidden[rows], residual[rows] = out, res
        self.hidden, self.residual = hidden, residual

    def final_hidden(self, norm: nn.Module) -> torch.Tensor:
        """The final norm's output after the last layer: what the LM head reads."""
        with torch.inference_mode():
            residual = None if self.residual is None else self.residual.clone()
            return norm(self.hidden.clone(), residual)[0]

    def _outputs(
        self, layer: nn.Module
    ) -> Iterator[tuple[slice, tuple[torch.Tensor, torch.Tensor]]]:
        total = self.hidden.shape[0]
        step = self.per_chunk * self.seq_len
        for start in range(0, total, step):
            rows = slice(start, min(start + step, total))
            count = (rows.stop - rows.start) // self.seq_len
            meta = AttentionMetadata.build(
                [self.seq_len] * count, [self.seq_len] * count, None, 16, None
            )
            positions = torch.arange(self.seq_len).repeat(count)
            # The fused norms add into the residual in place: give the layer copies.
            residual = None if self.residual is None else self.residual[rows].clone()
            with torch.inference_mode():
                yield rows, layer(positions, self.hidden[rows].clone(), residual, None, meta)


@contextmanager
def _observing(layer: nn.Module, observers: dict[str, InputObserver]) -> Iterator[None]:
    handles = [
        layer.get_submodule(name).register_forward_pre_hook(_hook(observe))
        for name, observe in observers.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _hook(observe: InputObserver) -> Callable[[nn.Module, tuple[torch.Tensor, ...]], None]:
    def hook(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        observe(args[0].reshape(-1, args[0].shape[-1]))

    return hook


def replace_module(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put `module` where `root.get_submodule(name)` was."""
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, module)
