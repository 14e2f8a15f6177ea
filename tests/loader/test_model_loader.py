"""load_model: a start imports no more of torch than serving needs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from tokenmill.model.layers import Embedding, Linear

LOAD_AND_LIST_MODULES = """
import sys
import torch
from tokenmill.loader.model_loader import load_model
loaded = load_model({path!r}, torch.bfloat16)
print(loaded.model.embed_tokens.weight.dtype)
print(",".join(name for name in ("torch._dynamo", "sympy") if name in sys.modules) or "-")
"""


def test_loading_a_model_imports_neither_torch_compiler_nor_sympy(smollm_path: Path) -> None:
    """Initialising or materialising meta-device weights through torch's Python references
    imports its compiler and sympy, a large share of every start."""
    script = LOAD_AND_LIST_MODULES.format(path=str(smollm_path))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    dtype, imported = result.stdout.split()[-2:]
    assert dtype == "torch.bfloat16"
    assert imported == "-"


def test_layers_built_off_the_meta_device_are_still_initialised() -> None:
    """Heads trained from scratch (train-eagle) build these on the CPU and need random weights."""
    torch.manual_seed(0)
    embedding, linear = Embedding(64, 8), Linear(8, 16)
    assert embedding.weight.std() > 0.5  # nn.Embedding's N(0, 1)
    assert 0 < linear.weight.abs().max() <= 8**-0.5  # kaiming uniform's bound
