"""The load path shared by the methods that learn from activations (GPTQ, AWQ, SmoothQuant):
load the float weights, cut calibration windows from the built-in text, let the method rewrite
the model; and what the two that end in group-wise int4 (GPTQ, AWQ) share on top of it.

Calibrating at load time is slow on a CPU (docs/quantization.md has the measured times);
the usual path is to run `tokenmill quantize` once and load the checkpoint it writes, which is
a plain copy of packed tensors.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from tokenmill.quant.calibration import token_windows
from tokenmill.quant.groupwise import CALIBRATED_GROUP_SIZE, quantize_lm_head_like_int4
from tokenmill.quant.linear import check_group_size
from tokenmill.quant.method import QuantMethod, check_bits
from tokenmill.quant.weight_source import WeightSource

DEFAULT_CALIB_SAMPLES = 64
DEFAULT_CALIB_SEQ_LEN = 512
# Decoders whose layers have the norms, merged projections and forward that calibration drives.
CALIBRATED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class CalibratedMethod(QuantMethod):
    def __init__(
        self,
        calib_samples: int = DEFAULT_CALIB_SAMPLES,
        calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN,
    ) -> None:
        for field, value in (("calib_samples", calib_samples), ("calib_seq_len", calib_seq_len)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{field} must be an int >= 1, got {value!r}")
        self.calib_samples = calib_samples
        self.calib_seq_len = calib_seq_len

    def load(self, model: nn.Module, source: WeightSource) -> None:
        architecture = source.config.architecture
        if architecture not in CALIBRATED_ARCHITECTURES:
            raise ValueError(
                f"quantization {self.name!r} supports {', '.join(CALIBRATED_ARCHITECTURES)}; "
                f"this model is {architecture}"
            )
        if source.tokenizer is None:
            raise ValueError(f"quantization {self.name!r} needs the model's tokenizer")
        model.load_weights(source.weights)
        samples = token_windows(
            source.tokenizer, "calibration", self.calib_samples, self.calib_seq_len
        )
        self.calibrate(model, samples)

    @abstractmethod
    def calibrate(self, model: nn.Module, samples: torch.Tensor) -> None:
        """Rewrite the loaded float `model` in place from calibration windows `samples`."""

    def options(self) -> dict[str, Any]:
        return {"calib_samples": self.calib_samples, "calib_seq_len": self.calib_seq_len}


class CalibratedInt4Method(CalibratedMethod):
    """Every decoder-layer linear to group-wise int4 by a calibrated search, the LM head as the
    int4 method keeps it, so these methods and round-to-nearest int4 differ only in the layers."""

    def __init__(
        self,
        group_size: int = CALIBRATED_GROUP_SIZE,
        bits: int = 4,
        calib_samples: int = DEFAULT_CALIB_SAMPLES,
        calib_seq_len: int = DEFAULT_CALIB_SEQ_LEN,
    ) -> None:
        super().__init__(calib_samples, calib_seq_len)
        check_bits(self.name, bits, (4,))
        self.group_size = check_group_size(group_size)

    def calibrate(self, model: nn.Module, samples: torch.Tensor) -> None:
        self.quantize_layers(model, samples)
        quantize_lm_head_like_int4(model)

    @abstractmethod
    def quantize_layers(self, model: nn.Module, samples: torch.Tensor) -> None:
        """Replace the decoder layers' float linears by int4 ones learnt from `samples`."""

    def search_options(self) -> dict[str, Any]:
        """The search's own settings, recorded after bits and group size."""
        return {}

    def options(self) -> dict[str, Any]:
        return {
            "bits": 4,
            "group_size": self.group_size,
            **self.search_options(),
            **super().options(),
        }
