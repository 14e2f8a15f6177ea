"""Attention over a flat batch of sequences whose keys and values live in a paged KV cache.

The runner describes the batch once per step in `AttentionMetadata`; every layer then writes
its new keys and values into the cache slots named there and attends over each sequence's
blocks. Without a cache (`kv_cache=None`) each sequence's query is its whole context, the
baseline that recomputes everything every step.

Cache layout per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V), a
tensor in the model dtype or, with `kv_cache_dtype` int8 / fp8, a `QuantizedKVCache` of 8-bit codes
and per-token scales (tokenmill/kv/quantized.py); only this module tells the two apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.draft_tree import depths, is_chain, path_flags
from tokenmill.kernels import ops
from tokenmill.kv.quantized import KVCache, QuantizedKVCache


@dataclass(frozen=True)
class PrefillSegment:
    """One sequence whose query has several tokens (a prompt chunk, or all of it)."""

    query_start: int
    query_end: int
    seq_len: int
    block_table: torch.Tensor | None  # [blocks_needed]; None when the context is just the query
    # A draft tree's chunk (tokenmill/spec/tree.py): which keys each query sees, and every
    # key's position (drafts sit at their depth, not their slot). None: causal.
    tree_mask: torch.Tensor | None = None  # [query_len, seq_len] bool
    key_positions: torch.Tensor | None = None  # [seq_len]

    @property
    def query_len(self) -> int:
        return self.query_end - self.query_start


MAX_DECODE_QUERY = 16
"""A chunk of up to this many tokens over a cached context (speculative drafts being verified)
attends token by token through the paged decode path: each token is a decode whose context
ends at itself, which is the causal mask for free, and decodes' own kernel and numerics."""

MAX_TREE_QUERY = 65
"""A chunk ending in a draft tree of up to this many tokens (the root and its drafts) attends
through the paged decode path too, with a key mask per draft hiding the other branches drafted
before it; a longer one (a resumed request's prompt with its tree) runs the masked prefill."""


@dataclass(frozen=True)
class DecodeGroup:
    """Tokens that each attend to their sequence's cached context, in one batched product:
    the new token of a decode, or every token of a short chunk."""

    token_index: torch.Tensor  # [B] positions of the tokens in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks] their sequences' tables
    seq_lens: torch.Tensor  # [B] context length of each, the token itself included
    # Draft trees' rows: which of each token's last key_mask.shape[1] keys it sees (a draft
    # sees its ancestors, not the other branches). None: every token sees its whole context.
    key_mask: torch.Tensor | None = None  # [B, width] bool


@dataclass(frozen=True)
class AttentionMetadata:
    """The batch's layout, built once per step and shared by every layer."""

    num_tokens: int
    slot_mapping: torch.Tensor | None  # [num_tokens] flat cache slot of each new token
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeGroup | None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]] | None,
        block_size: int,
        slot_mapping: Sequence[int] | None,
        draft_trees: Sequence[Sequence[int]] | None = None,
    ) -> AttentionMetadata:
        """`seq_lens[i]` counts sequence i's tokens in context once this step's are added.
        `draft_trees[i]`: the parents of the draft tree ending sequence i's query, () for none
        or a chain (both causal)."""
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        prefills: list[PrefillSegment] = []
        decode_rows: list[_DecodeRow] = []
        for i, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            cached = s_len - q_len
            parents = draft_trees[i] if draft_trees else ()
            if parents and not is_chain(parents):
                assert block_tables is not None, "a draft tree is verified over a KV cache"
                if q_len <= MAX_TREE_QUERY:
                    flags = [()] * (q_len - len(parents)) + path_flags(parents)
                    decode_rows += [
                        _DecodeRow(starts[i] + j, cached + j + 1, i, flags[j]) for j in range(q_len)
                    ]
                    continue
                table = torch.tensor(block_tables[i][: -(-s_len // block_size)], dtype=torch.long)
                mask, key_positions = _tree_layout(parents, q_len, s_len)
                prefills.append(
                    PrefillSegment(starts[i], starts[i + 1], s_len, table, mask, key_positions)
                )
                continue
            short_over_cache = cached > 0 and q_len <= MAX_DECODE_QUERY
            if block_tables is not None and (q_len == 1 or short_over_cache):
                decode_rows += [_DecodeRow(starts[i] + j, cached + j + 1, i) for j in range(q_len)]
                continue
            table = None
            if block_tables is not None and s_len > q_len:
                needed = -(-s_len // block_size)
                table = torch.tensor(block_tables[i][:needed], dtype=torch.long)
            prefills.append(PrefillSegment(starts[i], starts[i + 1], s_len, table))
        decode = None
        if decode_rows:
            assert block_tables is not None
            slots, decode = _decode_group(decode_rows, block_tables, block_size, slot_mapping)
        else:
            slots = None if slot_mapping is None else torch.tensor(slot_mapping, dtype=torch.long)
        return cls(starts[-1], slots, tuple(prefills), decode)

    @classmethod
    def for_decodes(
        cls,
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        slot_mapping: Sequence[int],
        visible: Sequence[tuple[bool, ...]],
    ) -> AttentionMetadata:
        """Every token a decode of its own: token i writes its KV to `slot_mapping[i]` and
        attends to the first `seq_lens[i]` keys of table `block_tables[i]`, its own last,
        less those its flags `visible[i]` clear among its last `len(visible[i])` keys (a
        drafter's tree nodes, which see only their ancestors)."""
        rows = [
            _DecodeRow(i, seq_len, i, flags)
            for i, (seq_len, flags) in enumerate(zip(seq_lens, visible, strict=True))
        ]
        slots, decode = _decode_group(rows, block_tables, block_size, slot_mapping)
        return cls(len(rows), slots, (), decode)

    def for_layer(self, layer: int) -> AttentionMetadata:
        """What layer `layer` reads: this, the same for every layer."""
        return self


@dataclass(frozen=True)
class GroupedAttentionMetadata:
    """A step's layout for a model whose layers sit in several KV-cache groups: the same batch,
    one `AttentionMetadata` per group (its own slots and block tables), and each layer's group.
    Only the layers' block ids differ; which tokens run and attend to what is the same."""

    groups: tuple[AttentionMetadata, ...]
    group_of: tuple[int, ...]  # per layer

    def for_layer(self, layer: int) -> AttentionMetadata:
        return self.groups[self.group_of[layer]]

    @property
    def num_tokens(self) -> int:
        return self.groups[0].num_tokens

    @property
    def slot_mapping(self) -> torch.Tensor | None:
        return self.groups[0].slot_mapping

    @property
    def prefills(self) -> tuple[PrefillSegment, ...]:
        return self.groups[0].prefills

    @property
    def decode(self) -> DecodeGroup | None:
        return self.groups[0].decode


StepMetadata = AttentionMetadata | GroupedAttentionMetadata


def _tree_layout(
    parents: Sequence[int], query_len: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A query ending in a draft tree: causal up to the tree's root, then each draft sees its
    ancestors (and itself). Returns (mask [query_len, seq_len], key positions [seq_len])."""
    n = len(parents)
    mask = torch.ones(query_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - query_len)
    drafts = mask[-n:, -n:]
    drafts.fill_(False)
    for i, parent in enumerate(parents):
        if parent >= 0:
            drafts[i] = drafts[parent]
        drafts[i, i] = True
    key_positions = torch.arange(seq_len)
    root = seq_len - n - 1
    key_positions[-n:] = root + torch.tensor(depths(parents))
    return mask, key_positions


@dataclass(frozen=True)
class _DecodeRow:
    token: int  # in the flat batch
    seq_len: int  # its context length, itself included
    sequence: int
    visible: tuple[bool, ...] = ()  # a tree draft's flags over its last keys (path_flags)


def _decode_group(
    rows: list[_DecodeRow],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    slot_mapping: Sequence[int] | None,
) -> tuple[torch.Tensor | None, DecodeGroup]:
    """The decode rows' group, and the batch's `slot_mapping` as a tensor (None stays None).
    Every step builds these, so the integers go to torch in two conversions: the padded
    block table, and one flat tensor the slots, lengths and token indices are views of."""
    max_blocks = max(-(-row.seq_len // block_size) for row in rows)
    padded: list[list[int]] = []
    for row in rows:
        used = list(block_tables[row.sequence][:max_blocks])
        padded.append(used + [0] * (max_blocks - len(used)))
    table = torch.tensor(padded, dtype=torch.long)
    slots = [] if slot_mapping is None else list(slot_mapping)
    lens = [row.seq_len for row in rows]
    index = [row.token for row in rows]
    flat = torch.tensor([*slots, *lens, *index], dtype=torch.long)
    slots_t, lens_t, index_t = flat.split_with_sizes([len(slots), len(lens), len(index)])
    group = DecodeGroup(index_t, table, lens_t, _key_mask([row.visible for row in rows]))
    return (None if slot_mapping is None else slots_t), group


def _key_mask(visible: list[tuple[bool, ...]]) -> torch.Tensor | None:
    """Rows' flags over their last keys, right-aligned in one [rows, width] mask (the keys
    before a row's flags are context it sees); None when no row hides a key."""
    if all(all(flags) for flags in visible):
        return None
    width = max(len(flags) for flags in visible)
    return torch.tensor([(True,) * (width - len(flags)) + flags for flags in visible])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: KVCache | None,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q: [T, heads, d]; k, v: [T, kv_heads, d] for this step's tokens. Returns [T, heads, d].

    With a sliding `window`, each token sees only itself and the `window - 1` tokens before it.
    """
    if kv_cache is not None and meta.slot_mapping is not None:
        if isinstance(kv_cache, QuantizedKVCache):
            kv_cache.store(meta.slot_mapping, k, v)
        else:
            ops.store_kv(kv_cache, meta.slot_mapping, k, v)
    group = meta.decode
    if group is not None and not meta.prefills:  # all decodes, in batch order: no scatter
        assert kv_cache is not None
        return _decode_attention(q, kv_cache, group, scale, window)
    out = torch.empty_like(q)
    for seg in meta.prefills:
        rows = slice(seg.query_start, seg.query_end)
        if seg.block_table is None:
            seg_k, seg_v = k[rows], v[rows]
        else:
            assert kv_cache is not None
            context = gather_context(kv_cache, seg.block_table, seg.seq_len)
            seg_k, seg_v = (t.to(q.dtype) for t in context)
        if seg.tree_mask is None:
            out[rows] = ops.prefill_attention(q[rows], seg_k, seg_v, scale, window)
        else:
            out[rows] = _tree_attention(q[rows], seg_k, seg_v, seg, scale, window)
    if group is not None:
        assert kv_cache is not None
        out[group.token_index] = _decode_attention(
            q[group.token_index], kv_cache, group, scale, window
        )
    return out


def _tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seg: PrefillSegment,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """A draft tree's chunk: its mask, narrowed by a sliding `window` over positions."""
    assert seg.tree_mask is not None and seg.key_positions is not None
    allowed = seg.tree_mask
    if window is not None:
        query_positions = seg.key_positions[-seg.query_len :]
        allowed = allowed & (query_positions[:, None] - seg.key_positions[None, :] < window)
    return ops.masked_attention(q, k, v, allowed, scale)


def _decode_attention(
    q: torch.Tensor, kv_cache: KVCache, group: DecodeGroup, scale: float, window: int | None
) -> torch.Tensor:
    if isinstance(kv_cache, QuantizedKVCache):
        return kv_cache.decode_attention(
            q, group.block_tables, group.seq_lens, scale, window, group.key_mask
        )
    return ops.paged_decode_attention(
        q, kv_cache, group.block_tables, group.seq_lens, scale, window, group.key_mask
    )


def gather_context(
    kv_cache: KVCache, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's first `seq_len` keys and values, read through its block table (fp32 from a
    quantized cache)."""
    if isinstance(kv_cache, QuantizedKVCache):
        keys, values = kv_cache.gather(block_table)
    else:
        keys, values = (ops.gather_blocks(cache, block_table) for cache in kv_cache)
    return keys[:seq_len], values[:seq_len]
