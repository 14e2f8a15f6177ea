"""The pool of fixed-size KV blocks: who holds each block, and which full blocks are cached.

A block with no holders goes to the back of the free queue but keeps its cached contents, so a
later request with the same prefix can take it back; allocation takes from the front, so the
least recently freed cached block is the one evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None  # set while the block's contents are in the prefix cache
    token_ids: tuple[int, ...] = ()


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """A full block's identity: a 128-bit digest chained through its parent's, so equal blocks
    at different prefixes differ. A hit also compares the token ids themselves."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included: all of them can be allocated."""
        return len(self._free)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        block = self._cached.get(block_hash) if self.enable_caching else None
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def allocate(self, count: int) -> list[KVBlock]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks with {len(self._free)} free")
        blocks = []
        for _ in range(count):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on cached blocks a new request reuses."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; callers pass a table tail-first, so when memory runs
        short the ends of sequences are evicted before the prefixes other requests share.
        A block with nothing cached goes to the front: reusing it evicts nobody's prefix."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} released more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: KVBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Publish a full block's contents; the first block cached under a hash keeps it."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
