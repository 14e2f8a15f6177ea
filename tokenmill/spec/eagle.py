"""EAGLE-style drafting: a one-layer head that extrapolates the target's own features.

Li et al. (EAGLE, 2024) observe that the target's last hidden state ("feature") is far easier
to predict one step ahead than the next token is. The head reads the feature at position p
together with the embedding of token p + 1, runs one decoder layer, and predicts the feature
at p + 1; the target's own output head turns that into the next draft, and the predicted
feature feeds the head again for the draft after it.

Costs are kept small for a CPU: the head has one decoder layer, and it scores only the
`draft_vocab` (the tokens most frequent in its training data, rows of the target's output
head) instead of the whole vocabulary. Its KV cache (one layer) is laid out like the target's
and shares its block tables; every step it computes the same real positions as the target
from the target's features, so prefix caching, preemption and rollback cover it as they do a
draft model. (The head's KV at the last position of a cached block depends on the token after
the block, so a request that shares the block but not that token drafts slightly worse there;
its output is unaffected.)

The drafts are a chain (each step's argmax fed back) or, as in EAGLE-2 (Li et al., 2024), a
tree whose shape follows the head's confidence (tokenmill/spec/eagle_tree.py). After a tree's
verification the head's KV follows the accepted path as it follows a chain: the runner moves
the path's target features into chain order, and the next catch-up recomputes the head's KV at
those positions from them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.kernels import ops
from tokenmill.kv.layout import allocate_kv_caches, kv_bytes_per_token, slot_mapping
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.decode_loop import NativeLayers
from tokenmill.model.layers import Linear, RMSNorm, RotaryEmbedding
from tokenmill.model.llama import LlamaDecoderLayer
from tokenmill.quant.int8 import Int8Linear
from tokenmill.scheduler_output import ScheduledRequest
from tokenmill.spec.draft_model import paged_chunk_batch
from tokenmill.spec.eagle_tree import Expand, TreeDraft, draft_trees
from tokenmill.spec.proposer import num_computed_after, token_ids_between

HEADS_DIR = Path(__file__).parent / "heads"
PACKAGED_HEADS = {"smollm2-135m-instruct": HEADS_DIR / "smollm2-135m-instruct.eagle.safetensors"}


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's decoder layer has the target's shapes; one layer of them."""
    return dataclasses.replace(target, num_hidden_layers=1, layer_types=None)


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig, draft_vocab_size: int) -> None:
        super().__init__()
        self.config = head_config(config)
        hidden = config.hidden_size
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.layer = LlamaDecoderLayer(self.config, rotary)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        # Token ids the head can draft, most frequent first; not a parameter.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long))

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        native: NativeLayers | None = None,
    ) -> torch.Tensor:
        """The predicted next features `[tokens, hidden]` from the embedding of each position's
        next token and the feature at the position. `native`, the decoder layer in one native
        call (bit-identical), runs the steps it applies to."""
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        if native is not None and native.applies(meta):
            hidden, residual = native.run(hidden, positions, meta)
        else:
            hidden, residual = self.layer(positions, hidden, None, kv_cache, meta)
        return self.norm(hidden, residual)[0]


def save_head(head: EagleHead, path: Path, target_name: str) -> None:
    """bf16 weights (the file ships with tokenmill) and the shapes they fit."""
    tensors = {
        name: t if name == "draft_vocab" else t.to(torch.bfloat16)
        for name, t in head.state_dict().items()
    }
    shape = {"hidden_size": head.config.hidden_size, "vocab_size": head.config.vocab_size}
    save_file(tensors, str(path), metadata={"target": target_name, "shape": json.dumps(shape)})


def load_head(path: Path, target: ModelConfig, dtype: torch.dtype) -> EagleHead:
    if not path.is_file():
        raise ValueError(f"EAGLE head {path} does not exist; train one with tokenmill train-eagle")
    tensors = load_file(str(path))
    head = EagleHead(target, draft_vocab_size=len(tensors["draft_vocab"]))
    expected = head.state_dict()
    for name, tensor in tensors.items():
        if name not in expected or expected[name].shape != tensor.shape:
            raise ValueError(
                f"EAGLE head {path} does not fit this model (tensor {name!r} of shape "
                f"{tuple(tensor.shape)}); train one for it with tokenmill train-eagle"
            )
    head.load_state_dict(
        {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    )
    return head.to(dtype).eval()


def draft_scorer(rows: torch.Tensor, dtype: torch.dtype) -> nn.Module:
    """The product scoring predicted features against the target's output `rows` for the draft
    vocabulary. Each draft reads all of them, so where the native int8 kernel serves float32
    activations they are int8 with a scale per row, a quarter of the bytes; the drafts are
    argmaxes, so a near-tie may go either way, and the output never depends on it. Anywhere
    else int8 would mean dequantizing every row for every draft, so they stay as they are."""
    if dtype == torch.float32 and ops.backend() == "native":
        return Int8Linear.from_float(rows.float())
    scorer = Linear(rows.shape[1], rows.shape[0], bias=False, dtype=dtype)
    scorer.weight.data.copy_(rows)
    return scorer.requires_grad_(False)


def output_rows(target: nn.Module, token_ids: torch.Tensor) -> torch.Tensor:
    """Rows of the target's output head for `token_ids` (its embedding when they are tied)."""
    weight = getattr(target.lm_head, "weight", None)
    if weight is None or weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        # A quantized head: tied models share embeddings (maybe read from the head's own rows).
        return target.embed_tokens(token_ids).detach().clone()
    return weight[token_ids].detach().clone()


@dataclass
class EagleDrafter:
    """A loaded head bound to its target: what the engine needs to size KV and draft."""

    head: EagleHead
    target: nn.Module
    scorer: nn.Module  # [hidden] -> [draft_vocab] logits (`draft_scorer`)
    shares_target_kv = False  # the head keeps KV of its own, through the first group's table

    @classmethod
    def load(cls, path: Path, target: LoadedModel, dtype: torch.dtype) -> EagleDrafter:
        head = load_head(path, target.config, dtype)
        rows = output_rows(target.model, head.draft_vocab)
        return cls(head, target.model, draft_scorer(rows, dtype))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(self.head.config, dtype)


class EagleProposer:
    def __init__(
        self,
        drafter: EagleDrafter,
        num_blocks: int,
        block_size: int,
        tree: bool = False,
        min_score: float = 0.0,
    ) -> None:
        """`tree`: draft EAGLE-2's dynamic tree of up to `num_tokens_to_draft` nodes, each
        scoring at least `min_score`; else a chain."""
        self.drafter = drafter
        self.block_size = block_size
        self.tree = tree
        self.min_score = min_score
        dtype = drafter.head.fc.weight.dtype
        (self.kv_cache,) = allocate_kv_caches(drafter.head.config, num_blocks, block_size, dtype)
        self.own_kv_caches = [self.kv_cache]
        self.native = NativeLayers.build([drafter.head.layer], [self.kv_cache])
        self._parents: dict[str, list[int]] = {}

    def propose(
        self,
        scheduled: Sequence[ScheduledRequest],
        emitted: Mapping[str, list[int]],
        hidden: torch.Tensor,
    ) -> dict[str, list[int]]:
        chunks, features, row = [], [], 0
        for item in scheduled:
            chunk = _catch_up(item, emitted.get(item.request.request_id, []))
            if chunk is not None:
                chunks.append(chunk)
                features.append(hidden[row : row + chunk.end - chunk.start])
            row += item.num_new_tokens
        self._parents = {}
        proposals: dict[str, list[int]] = {c.request_id: [] for c in chunks if c.num_to_draft}
        if not chunks:
            return proposals
        with torch.inference_mode():
            if self.tree:
                return self._propose_trees(chunks, torch.cat(features))
            predicted = torch.cat(features)
            while chunks:
                # The first pass catches up on real positions; later ones feed drafts back.
                predicted, logits = self._forward(chunks, predicted)
                tokens = self._argmax(logits)
                chunks = [chunk for chunk in chunks if chunk.num_to_draft]
                for chunk, token in zip(chunks, tokens, strict=True):
                    proposals[chunk.request_id].append(token)
                keep = [
                    i
                    for i, chunk in enumerate(chunks)
                    if len(proposals[chunk.request_id]) < chunk.num_to_draft
                ]
                chunks = [chunks[i].next_draft(tokens[i]) for i in keep]
                predicted = predicted[keep]
        return proposals

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """The head's drafts are argmaxes."""
        return None

    def draft_parents(self, request_id: str) -> list[int] | None:
        """The request's tree from the last `propose`; None for a chain."""
        return self._parents.get(request_id)

    def _propose_trees(self, chunks: list[_Chunk], features: torch.Tensor) -> dict[str, list[int]]:
        """Catch up, then grow each drafting request's tree (eagle_tree.draft_trees), feeding
        its expanded nodes through the head at the positions past its real tokens."""
        predicted, logits = self._forward(chunks, features)
        drafting = [chunk for chunk in chunks if chunk.num_to_draft]
        vocab = self.drafter.head.draft_vocab
        trees = [TreeDraft(chunk.num_to_draft, self.min_score) for chunk in drafting]
        draft_trees(trees, predicted, logits, vocab, self._expand(drafting))
        proposals = {}
        for chunk, tree in zip(drafting, trees, strict=True):
            proposals[chunk.request_id], self._parents[chunk.request_id] = tree.best()
        return proposals

    def _expand(self, chunks: Sequence[_Chunk]) -> Expand:
        """The head's pass over one round of tree nodes: `(request, fed index, token, depth,
        visible)` per node, its parent's predicted feature a row of `features`; returns each
        node's predicted feature and draft logits. A request's j-th fed node sits at position
        `end + depth - 1`, its KV in the slot of position `end + j` (a lookahead slot the
        scheduler reserved), and sees the context and its fed ancestors (`visible`)."""

        def expand(
            nodes: Sequence[tuple[int, int, int, int, tuple[bool, ...]]], features: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            drafter = self.drafter
            seq_lens, tables, slots, positions = [], [], [], []
            for request, fed, _, depth, _ in nodes:
                chunk = chunks[request]
                seq_lens.append(chunk.end + fed + 1)
                tables.append(chunk.block_ids)
                slots += slot_mapping(
                    chunk.block_ids, self.block_size, chunk.end + fed, chunk.end + fed + 1
                )
                positions.append(chunk.end + depth - 1)
            meta = AttentionMetadata.for_decodes(
                seq_lens, tables, self.block_size, slots, [node[4] for node in nodes]
            )
            ids = torch.tensor([node[2] for node in nodes], dtype=torch.long)
            embeds = drafter.target.embed_tokens(ids)
            out = drafter.head(
                embeds, features, torch.tensor(positions), self.kv_cache, meta, self.native
            )
            return out, drafter.scorer(out)

        return expand

    def _forward(
        self, chunks: Sequence[_Chunk], features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the head over the chunks; the predicted feature and draft logits at the last
        position of each chunk that drafts."""
        drafter = self.drafter
        ids, positions, meta, rows = paged_chunk_batch(
            chunks, [c.next_token_ids for c in chunks], self.block_size
        )
        embeds = drafter.target.embed_tokens(ids)
        out = drafter.head(embeds, features, positions, self.kv_cache, meta, self.native)
        last = out[rows]
        return last, drafter.scorer(last)

    def _argmax(self, logits: torch.Tensor) -> list[int]:
        return self.drafter.head.draft_vocab[logits.argmax(dim=-1)].tolist()


def _catch_up(item: ScheduledRequest, gained: list[int]) -> _Chunk | None:
    """The positions whose features the target just computed (real tokens only), each paired
    with the token after it; the request drafts from the last one."""
    start, computed = item.num_computed_tokens, num_computed_after(item, gained)
    if computed <= start:
        return None
    next_ids = token_ids_between(item, gained, start + 1, computed + 1)
    num_to_draft = item.num_tokens_to_draft if gained else 0
    return _Chunk(item.request.request_id, item.block_ids, start, computed, next_ids, num_to_draft)


@dataclass
class _Chunk:
    request_id: str
    block_ids: list[int]
    start: int
    end: int
    next_token_ids: list[int]  # the token after each position
    num_to_draft: int

    def next_draft(self, token: int) -> _Chunk:
        """The one-position chunk that pairs the latest predicted feature with its draft."""
        return _Chunk(
            self.request_id, self.block_ids, self.end, self.end + 1, [token], self.num_to_draft
        )
