"""TiedInt8Embedding: a GGUF model's lookups read its tied int8 LM head's rows, with the bits
of the dequantized table they replace."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.loader.model_loader import load_model
from tokenmill.quant.gguf import EMBEDDING_ENV
from tokenmill.quant.int8 import Int8Linear
from tokenmill.quant.tied_embedding import TiedInt8Embedding
from tokenmill.spec.eagle import output_rows


def float_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.is_floating_point())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_token_embeds_as_the_dequantized_table_does(
    smollm_path: Path, monkeypatch, dtype: torch.dtype
) -> None:
    rows = load_model(str(smollm_path), dtype, "gguf").model
    monkeypatch.setenv(EMBEDDING_ENV, "table")
    table = load_model(str(smollm_path), dtype, "gguf").model
    assert isinstance(rows.embed_tokens, TiedInt8Embedding)
    assert isinstance(table.embed_tokens, torch.nn.Embedding)
    every_token = torch.arange(table.config.vocab_size).view(64, -1)
    assert torch.equal(rows.embed(every_token), table.embed(every_token))
    # The table is the only float tensor of vocabulary x hidden the rows leave out.
    vocab, hidden = table.embed_tokens.weight.shape
    assert float_numel(table) - float_numel(rows) == vocab * hidden


def test_a_drafters_output_rows_come_from_the_heads_rows(quantized_smollm, smollm) -> None:
    """EAGLE and Medusa score drafts with the target's output rows: a quantized head gives them
    its embedding's, read from the head, as the float model (the same file dequantized) holds
    them."""
    ids = torch.tensor([0, 17, 2048, 49151])
    rows = output_rows(quantized_smollm("gguf").model, ids)
    assert rows.shape == (4, 576) and rows.dtype == torch.float32
    assert torch.equal(rows, smollm.model.embed_tokens.weight[ids])


def test_a_head_without_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="whole groups"):
        TiedInt8Embedding(Int8Linear(64, 8, bias=False), torch.float32)
