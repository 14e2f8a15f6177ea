"""Hugging Face directories: an exported copy of the GGUF model loads to the same model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenmill.config import EngineArgs
from tokenmill.loader.errors import ModelLoadError
from tokenmill.loader.export import export_hf
from tokenmill.loader.hf_dir import SHARD_INDEX, hf_model_config
from tokenmill.loader.model_loader import load_model
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.layers import prepack_linears

TEXT = "Paged attention keeps the KV cache in fixed-size blocks."


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm_path) -> Path:
    return export_hf(str(smollm_path), tmp_path_factory.mktemp("smollm-hf"))


def logits(loaded, ids: list[int]) -> torch.Tensor:
    """With the float weights packed as an engine packs them: the shared model may already be,
    and packed and plain weights take different kernels, equal only to rounding."""
    prepack_linears(loaded.model, EngineArgs().max_num_seqs)
    meta = AttentionMetadata.build([len(ids)], [len(ids)], None, 16, None)
    with torch.inference_mode():
        return loaded.model.compute_logits(
            loaded.model(torch.tensor(ids), torch.arange(len(ids)), None, meta)
        )


def test_exported_directory_loads_to_identical_logits_and_tokens(hf_dir, smollm):
    loaded = load_model(str(hf_dir))
    ids = smollm.tokenizer.encode(TEXT)
    assert loaded.tokenizer.encode(TEXT) == ids
    assert loaded.tokenizer.chat_template == smollm.tokenizer.chat_template
    assert loaded.config == smollm.config
    assert torch.equal(logits(loaded, ids), logits(smollm, ids))


def test_sharded_checkpoint_with_index_loads_the_same(hf_dir, tmp_path, smollm):
    tensors = load_file(hf_dir / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, tmp_path / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (tmp_path / SHARD_INDEX).write_text(json.dumps({"weight_map": weight_map}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    loaded = load_model(str(tmp_path))
    ids = smollm.tokenizer.encode(TEXT)
    assert torch.equal(logits(loaded, ids), logits(smollm, ids))


def test_transformers_reads_the_exported_directory(hf_dir, smollm):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = smollm.tokenizer.encode(TEXT)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    ours = logits(smollm, ids)
    assert ((ours - expected).norm(dim=-1) / expected.norm(dim=-1)).max() < 1e-4


def test_directory_without_config_names_what_is_missing(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_truncated_safetensors_is_reported_with_its_path(hf_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(tmp_path))


def test_missing_tensor_is_named(hf_dir, tmp_path):
    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((hf_dir / name).read_bytes())
    with pytest.raises(ValueError, match="layers.3.mlp.gate_up_proj"):
        load_model(str(tmp_path))


LLAMA_CONFIG = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "vocab_size": 1000,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize(
    ("fields", "windows"),
    [
        ({"sliding_window": 64}, (64, 64, 64, 64)),
        ({"sliding_window": None}, (None,) * 4),
        ({"sliding_window": 64, "use_sliding_window": False, "max_window_layers": 2}, (None,) * 4),
        (
            {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 2},
            (None, None, 64, 64),
        ),
    ],
    ids=["mistral", "mistral-without", "qwen2-off", "qwen2-on"],
)
def test_a_llama_family_config_gives_its_layers_their_sliding_window(tmp_path, fields, windows):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA_CONFIG, **fields}))
    assert hf_model_config(tmp_path).layer_windows == windows
