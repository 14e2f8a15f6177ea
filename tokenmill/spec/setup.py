"""From EngineArgs to the parts of speculative decoding the engine wires in: the scheduler's
policy, the draft model (whose KV the pool must also hold) and the runner's proposer."""

from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.config import EngineArgs
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.loader.resolve import DEFAULT_MODEL, resolve_model
from tokenmill.quant.prepare import prepare_weights
from tokenmill.spec.draft_model import DraftModel, DraftModelProposer, load_draft_model
from tokenmill.spec.eagle import PACKAGED_HEADS, EagleDrafter, EagleProposer
from tokenmill.spec.medusa import PACKAGED_MEDUSA_HEADS, MedusaDrafter, MedusaProposer
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.policy import SpeculationPolicy
from tokenmill.spec.proposer import Proposer


def speculation_policy(args: EngineArgs) -> SpeculationPolicy | None:
    if args.speculative_method is None:
        return None
    drafts_trees = args.speculative_method in ("medusa", "eagle") and args.speculative_tree
    return SpeculationPolicy(
        num_speculative_tokens=args.num_speculative_tokens,
        disable_batch_size=args.speculative_disable_batch_size,
        # A tree's size is its budget, not a run to extend or cut after each verification.
        adaptive=args.speculative_adaptive_k and not drafts_trees,
        drafter_writes_kv=args.speculative_method not in ("ngram", "medusa"),
    )


def load_draft(
    args: EngineArgs, target: LoadedModel, dtype: torch.dtype, max_model_len: int
) -> DraftModel | EagleDrafter | MedusaDrafter | None:
    """The draft model, EAGLE head or Medusa heads, loaded once: the KV pool is sized for a
    drafter's KV too."""
    if args.speculative_method == "eagle":
        return EagleDrafter.load(eagle_head_path(args), target, dtype)
    if args.speculative_method == "medusa":
        heads = head_path(args, PACKAGED_MEDUSA_HEADS, "train-medusa")
        return MedusaDrafter.load(heads, target, dtype)
    if args.speculative_method != "draft":
        return None
    assert args.draft_model is not None
    draft = load_draft_model(args.draft_model, target, dtype, args.draft_quantization)
    if draft.config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft_model {args.draft_model!r} handles {draft.config.max_position_embeddings} "
            f"positions, fewer than max_model_len={max_model_len}; lower max_model_len"
        )
    return draft


def eagle_head_path(args: EngineArgs) -> Path:
    return head_path(args, PACKAGED_HEADS, "train-eagle")


def head_path(args: EngineArgs, packaged: dict[str, Path], trainer: str) -> Path:
    """`draft_model` when given, else the heads that ship for the packaged default model."""
    if args.draft_model is not None:
        return Path(args.draft_model)
    for name, head in packaged.items():
        if args.model == name or Path(args.model).expanduser() == resolve_model(name):
            return head
    raise ValueError(
        f"no {args.speculative_method} heads ship for model {args.model!r} (only for "
        f"{DEFAULT_MODEL}); train them with `tokenmill {trainer}` and pass them as draft_model"
    )


def build_proposer(
    args: EngineArgs,
    draft: DraftModel | EagleDrafter | MedusaDrafter | None,
    kv_caches: list[torch.Tensor] | None,
    num_blocks: int,
) -> Proposer | None:
    if args.speculative_method == "ngram":
        return NgramProposer(args.prompt_lookup_min, args.prompt_lookup_max)
    if isinstance(draft, MedusaDrafter):
        return MedusaProposer(
            draft, tree=args.speculative_tree, min_score=args.speculative_tree_min_score
        )
    if isinstance(draft, EagleDrafter):
        return EagleProposer(
            draft,
            num_blocks,
            args.block_size,
            tree=args.speculative_tree,
            min_score=args.speculative_tree_min_score,
        )
    if draft is not None:
        assert kv_caches is not None
        caches = draft.kv_caches(kv_caches, num_blocks, args.block_size)
        # Before the runner prepares the target: an early exit's layers are the target's.
        prepare_weights(draft.model, args.prepack_batch_hint)
        return DraftModelProposer(
            draft,
            caches,
            args.block_size,
            native_decode_loop=args.decode_loop == "native",
            sample_drafts=args.draft_sampling == "sample",
        )
    return None
