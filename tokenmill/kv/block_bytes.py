"""One KV block as bytes: every layer's K and V for the block's token range, in the pool's dtype
(an int8 / fp8 cache's codes followed by their scales), so a block can leave the pool and come
back bit for bit.

A block's payload is, for each cache in order and each of its tensors (a plain cache: one; a
quantized cache: codes, then scales), that tensor's `[2, block_size, ...]` slice for the block.
"""

from __future__ import annotations

import torch

from tokenmill.kv.quantized import KVCache, QuantizedKVCache


def _byte_views(caches: list[KVCache]) -> list[torch.Tensor]:
    """Each cache tensor as bytes, `[2, num_blocks, ...]` with the element bytes in the last dim
    (index_select and index_copy_ have no fp8 kernels; bytes move any dtype)."""
    tensors = []
    for cache in caches:
        parts = (cache.values, cache.scales) if isinstance(cache, QuantizedKVCache) else (cache,)
        tensors += [t.view(torch.uint8) for t in parts]
    return tensors


def cache_layouts(caches: list[KVCache]) -> list[list]:
    """Each cache tensor's dtype and per-block shape: what a payload's bytes mean."""
    layouts = []
    for cache in caches:
        parts = (cache.values, cache.scales) if isinstance(cache, QuantizedKVCache) else (cache,)
        layouts += [[str(t.dtype), [t.shape[0], *t.shape[2:]]] for t in parts]
    return layouts


def block_payload_bytes(caches: list[KVCache]) -> int:
    return sum(t[:, 0].numel() for t in _byte_views(caches))


def read_blocks(caches: list[KVCache], block_ids: list[int]) -> list[bytes]:
    """The payloads of these blocks, copied out of the caches."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.long)
    parts = [
        t.index_select(1, ids).transpose(0, 1).reshape(len(block_ids), -1)
        for t in _byte_views(caches)
    ]
    rows = torch.cat(parts, dim=1).numpy()
    return [row.tobytes() for row in rows]


def write_blocks(caches: list[KVCache], block_ids: list[int], payloads: list[bytes]) -> None:
    """Store payloads (from `read_blocks`, perhaps of another process) into these blocks."""
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.long)
    rows = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    rows = rows.view(len(block_ids), -1)
    offset = 0
    for tensor in _byte_views(caches):
        width = tensor[:, 0].numel()
        shape = (len(block_ids), tensor.shape[0], *tensor.shape[2:])
        part = rows[:, offset : offset + width].reshape(shape).transpose(0, 1)
        tensor.index_copy_(1, ids, part)
        offset += width
