"""A token embedding read from the int8 rows of the LM head it is tied to.

A GGUF file with tied embeddings stores one token_embd tensor, and quantization="gguf" holds
the LM head on its blocks (Q8_0 as int8 in groups of 32, tokenmill/quant/gguf.py). Looking the
embeddings up in the same rows, as llama.cpp does, saves the float table a lookup would
otherwise keep beside them: vocabulary x hidden floats, large for a large vocabulary. A row
dequantizes as the table's did (the int8 value times its group's fp16 scale, in float32, then
cast to the model's dtype), so the embeddings keep their bits.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.quant.int8 import Int8Linear


class TiedInt8Embedding(nn.Module):
    def __init__(self, head: Int8Linear, dtype: torch.dtype) -> None:
        if head.group_size is None or head.in_features % head.group_size:
            raise ValueError("TiedInt8Embedding needs an int8 head in whole groups of inputs")
        super().__init__()
        # Not a submodule: the head's parameters belong to the LM head alone.
        self._head = (head,)
        self.dtype = dtype
        self.embedding_dim = head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # Few ops: a decode step's lookup runs right after the layers have streamed their
        # weights through the caches, where every op's dispatch is slow.
        values, scales = self._grouped()
        flat = input_ids if input_ids.dim() == 1 else input_ids.reshape(-1)
        rows = torch.mul(values.index_select(0, flat), scales.index_select(0, flat))
        if self.dtype != torch.float32:
            rows = rows.to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def _grouped(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's int8 values [vocab, groups, group] and its scales as float32 [vocab,
        groups, 1] (an eighth of the int8 values' bytes), made again only when the head's
        tensors change."""
        head = self._head[0]
        key = (head.qweight.data_ptr(), head.qweight._version, head.scales._version)
        if getattr(self, "_grouped_key", None) != key:
            vocab, group = head.out_features, head.group_size
            values = head.qweight[:, : self.embedding_dim].reshape(vocab, -1, group)
            self._grouped_tensors = (values, head.scales.float()[:, :, None])
            self._grouped_key = key
        return self._grouped_tensors

    def extra_repr(self) -> str:
        return f"{self._head[0].out_features}, {self.embedding_dim}, int8 rows of the LM head"
