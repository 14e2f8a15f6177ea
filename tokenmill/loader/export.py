"""`tokenmill export-hf`: write a GGUF model as a Hugging Face directory (fp32 safetensors).

Engines that read only Hugging Face directories (vLLM, for one) can then run the very weights
tokenmill runs, so benchmarks compare engines rather than checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.gguf_model import gguf_model_config, gguf_weights
from tokenmill.loader.hf_dir import write_hf_dir
from tokenmill.loader.resolve import resolve_model
from tokenmill.loader.tokenizer import Tokenizer


def export_hf(model: str, out_dir: Path) -> Path:
    path = resolve_model(model)
    if path.is_dir():
        raise ModelLoadError(f"{path}: already a Hugging Face directory; nothing to export")
    gguf = GGUFFile(path)
    config = gguf_model_config(gguf)
    write_hf_dir(out_dir, config, gguf_weights(gguf, config, torch.float32))
    Tokenizer.from_gguf_metadata(gguf.metadata).save_pretrained(out_dir)
    return out_dir
