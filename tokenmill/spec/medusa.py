"""Medusa drafting: K small heads on the target's last hidden state, verified as a tree.

Cai et al. (Medusa, 2024) add heads to the target: head k reads the final hidden state at
position p and proposes the token at p + 1 + k, each head a residual block (x + SiLU(W x + b))
feeding the target's own output head. The heads need no KV cache and no pass of their own: a
draft costs K small products on a hidden state the target already computed.

The heads guess independently of each other, so one guess per head would rarely be right K
times in a row; their top candidates form a tree instead, and the target verifies all of it in
one pass (tokenmill/draft_tree.py). The tree follows the heads' confidence, as EAGLE-2's
dynamic tree does: a candidate's score is the product of its heads' probabilities down its
path, and the `num_speculative_tokens` best-scoring candidates are drafted. A child never
scores above its parent, so parents always come first.

As in the EAGLE head (tokenmill/spec/eagle.py), the heads score only a draft vocabulary (the
tokens most frequent in their training data) through the target's rows for those tokens.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.model.layers import Linear
from tokenmill.scheduler_output import ScheduledRequest
from tokenmill.spec.eagle import HEADS_DIR, draft_scorer, output_rows

PACKAGED_MEDUSA_HEADS = {
    "smollm2-135m-instruct": HEADS_DIR / "smollm2-135m-instruct.medusa.safetensors"
}
CANDIDATES_PER_HEAD = 4
"""Top tokens of each head a tree may branch into."""


class MedusaHeads(nn.Module):
    """`num_heads` residual blocks; head k (from 0) proposes the token k + 2 places after the
    position whose hidden state it reads (the target's own head proposes the next one)."""

    def __init__(self, hidden_size: int, num_heads: int, draft_vocab_size: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for block in self.blocks:  # each head starts as the target's own next-token guess
            nn.init.zeros_(block.weight)
            nn.init.zeros_(block.bias)
        # Token ids the heads can draft, most frequent first; not a parameter.
        self.register_buffer("draft_vocab", torch.zeros(draft_vocab_size, dtype=torch.long))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[num_heads, tokens, hidden]`: each head's features, for the output rows to score."""
        return torch.stack([hidden + nn.functional.silu(block(hidden)) for block in self.blocks])


def save_medusa_heads(heads: MedusaHeads, path: Path, target_name: str) -> None:
    """bf16 weights (the file ships with tokenmill) and the shapes they fit."""
    tensors = {
        name: t if name == "draft_vocab" else t.to(torch.bfloat16)
        for name, t in heads.state_dict().items()
    }
    shape = {"hidden_size": heads.blocks[0].in_features, "num_heads": len(heads.blocks)}
    save_file(tensors, str(path), metadata={"target": target_name, "shape": json.dumps(shape)})


def load_medusa_heads(path: Path, target: ModelConfig, dtype: torch.dtype) -> MedusaHeads:
    if not path.is_file():
        raise ValueError(
            f"Medusa heads {path} do not exist; train them with tokenmill train-medusa"
        )
    tensors = load_file(str(path))
    num_heads = sum(1 for name in tensors if name.endswith(".weight"))
    heads = MedusaHeads(target.hidden_size, num_heads, len(tensors["draft_vocab"]))
    expected = heads.state_dict()
    for name, tensor in tensors.items():
        if name not in expected or expected[name].shape != tensor.shape:
            raise ValueError(
                f"Medusa heads {path} do not fit this model (tensor {name!r} of shape "
                f"{tuple(tensor.shape)}); train heads for it with tokenmill train-medusa"
            )
    heads.load_state_dict(tensors)
    return heads.to(dtype).eval().requires_grad_(False)


def fused_blocks(heads: MedusaHeads) -> Linear:
    """Every head's block as one product `[hidden] -> [num_heads * hidden]`: the heads read
    the same hidden state, so one pass over their stacked weights (a native kernel's) replaces
    a product, an activation and a sum per head."""
    blocks = heads.blocks
    weight = torch.cat([block.weight for block in blocks])
    fused = Linear(weight.shape[1], weight.shape[0], bias=True, dtype=weight.dtype)
    fused.weight.data.copy_(weight)
    fused.bias.data.copy_(torch.cat([block.bias for block in blocks]))
    return fused.requires_grad_(False)


@dataclass
class MedusaDrafter:
    """Loaded heads bound to the target's output rows for their draft vocabulary."""

    heads: MedusaHeads
    scorer: nn.Module  # [hidden] -> [draft_vocab] logits
    shares_target_kv = False

    def __post_init__(self) -> None:
        self.blocks = fused_blocks(self.heads)

    @classmethod
    def load(cls, path: Path, target: LoadedModel, dtype: torch.dtype) -> MedusaDrafter:
        heads = load_medusa_heads(path, target.config, dtype)
        return cls(heads, draft_scorer(output_rows(target.model, heads.draft_vocab), dtype))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 0  # the heads read the target's hidden states only

    def candidates(self, hidden: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
        """Each head's top tokens and their probabilities for one hidden state `[hidden]`."""
        num_heads = len(self.heads.blocks)
        branches = self.blocks(hidden.unsqueeze(0)).view(num_heads, -1)
        features = hidden + nn.functional.silu(branches)  # [num_heads, hidden], as the heads'
        probs = self.scorer(features).float().softmax(dim=-1)
        top = probs.topk(CANDIDATES_PER_HEAD, dim=-1)
        tokens = self.heads.draft_vocab[top.indices]
        return tokens.tolist(), top.values.tolist()


def confident_tree(
    tokens: Sequence[Sequence[int]],
    probs: Sequence[Sequence[float]],
    size: int,
    min_score: float = 0.0,
) -> tuple[list[int], list[int]]:
    """The `size` candidates with the highest path scores (product of each head's probability
    of its token down the path), none scoring below `min_score`: (draft tokens, parents),
    parents first. Head d gives the candidates at depth d + 1 whatever their parent."""
    drafts: list[int] = []
    parents: list[int] = []
    # (-score, tie-break, depth, rank, parent node)
    frontier = [(-probs[0][r], r, 0, r, -1) for r in range(len(tokens[0]))]
    heapq.heapify(frontier)
    counter = len(frontier)
    while frontier and len(drafts) < size:
        negative_score, _, depth, rank, parent = heapq.heappop(frontier)
        if -negative_score < min_score:
            break  # the best left: every other candidate scores no higher
        node = len(drafts)
        drafts.append(tokens[depth][rank])
        parents.append(parent)
        if depth + 1 < len(tokens):
            for r, p in enumerate(probs[depth + 1]):
                heapq.heappush(frontier, (negative_score * p, counter, depth + 1, r, node))
                counter += 1
    return drafts, parents


class MedusaProposer:
    own_kv_caches: Sequence[torch.Tensor] = ()

    def __init__(self, drafter: MedusaDrafter, tree: bool = True, min_score: float = 0.0) -> None:
        """`tree=False` drafts each head's top token as a chain (the baseline of the tree);
        a tree leaves out candidates scoring below `min_score`."""
        self.drafter = drafter
        self.tree = tree
        self.min_score = min_score
        self._parents: dict[str, list[int]] = {}

    def propose(
        self,
        scheduled: Sequence[ScheduledRequest],
        emitted: Mapping[str, list[int]],
        hidden: torch.Tensor,
    ) -> dict[str, list[int]]:
        """From the hidden state of the position before each request's newest token (the
        runner has moved an accepted tree path into chain order), the heads guess the tokens
        after that newest one."""
        self._parents = {}
        proposals: dict[str, list[int]] = {}
        row = 0
        for item in scheduled:
            gained = emitted.get(item.request.request_id, [])
            if gained and item.num_tokens_to_draft:
                last = item.request.num_tokens + len(gained) - 2  # position of that state
                with torch.inference_mode():
                    tokens, probs = self.drafter.candidates(
                        hidden[row + last - item.num_computed_tokens]
                    )
                if self.tree:
                    drafts, parents = confident_tree(
                        tokens, probs, item.num_tokens_to_draft, self.min_score
                    )
                    self._parents[item.request.request_id] = parents
                else:
                    drafts = [top[0] for top in tokens[: item.num_tokens_to_draft]]
                proposals[item.request.request_id] = drafts
            row += item.num_new_tokens
        return proposals

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> None:
        """The tree's candidates are chosen deterministically (one-hot)."""
        return None

    def draft_parents(self, request_id: str) -> list[int] | None:
        return self._parents.get(request_id)
