"""A smaller model drafts greedily; the target verifies.

Two kinds of draft model:

- `self:layers=N`: the target's own first N decoder layers, then its final norm and head (an
  early exit; no extra weights). Its KV for those layers is, for every real token, exactly the
  target's own, so it reads and writes the target's cache. That is safe: it only writes slots
  at or after the request's first uncomputed position, and the target rewrites every such slot
  in the step that computes it, before anything reads it.
- another model with the same vocabulary (`--draft-model PATH`), with KV caches of its own laid
  out like the target's and addressed through the same block tables, so prefix caching,
  preemption and rollback cover it for free. Every step it computes the same real tokens as the
  target, so a block published to the prefix cache holds valid draft KV too. It may be
  quantized at load time (`--draft-quantization`): the target's own checkpoint as int4 agrees
  with the target on most tokens and reads a seventh of its bytes a step.

Both run their decode steps through the native decode loop, as the target does: a draft step is
one token, where calling 30 layers from Python would cost more than their kernels.

Drafts are the draft model's argmax (a deterministic proposal: the rejection sampler treats q
as one-hot, which keeps sampled requests exact and a seeded request's tokens those of plain
decoding), or with `draft_sampling="sample"` a sampled request's draws from the draft's own
distribution q, which the rejection sampler then uses: with q close to the target's p, most
draws are accepted even at a high temperature, where an argmax draft is accepted only with
the target's probability of it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.kernels import ops
from tokenmill.kv.layout import allocate_kv_caches, kv_bytes_per_token, slot_mapping
from tokenmill.kv.quantized import KVCache
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.model.attention import AttentionMetadata
from tokenmill.model.decode_loop import NativeDecodeLoop, run_step
from tokenmill.model.registry import build_model
from tokenmill.sampling.sampler import SamplingRow, adjust_logits, make_generator, sampling_probs
from tokenmill.scheduler_output import ScheduledRequest
from tokenmill.spec.proposer import num_computed_after, token_ids_between

SELF_DRAFT = re.compile(r"self:layers=(\d+)")


@dataclass
class DraftModel:
    model: nn.Module
    config: ModelConfig
    shares_target_kv: bool  # an early exit of the target: its KV is the target's first layers

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What the draft adds to each token's KV footprint."""
        return 0 if self.shares_target_kv else kv_bytes_per_token(self.config, dtype)

    def kv_caches(
        self, target_caches: list[KVCache], num_blocks: int, block_size: int
    ) -> list[KVCache]:
        """The target's first layers for an early exit; else caches of its own, in the draft's
        dtype whatever the target's kv_cache_dtype: a small model's KV costs little."""
        if self.shares_target_kv:
            return target_caches[: self.config.num_hidden_layers]
        dtype = self.model.norm.weight.dtype
        return allocate_kv_caches(self.config, num_blocks, block_size, dtype)


def load_draft_model(
    spec: str, target: LoadedModel, dtype: torch.dtype, quantization: str = "none"
) -> DraftModel:
    """`spec` is "self:layers=N" or anything `--model` accepts, sharing the target's vocabulary,
    loaded with `quantization`."""
    match = SELF_DRAFT.fullmatch(spec)
    if match:
        if quantization != "none":
            raise ValueError(
                "draft_quantization applies to a draft_model file; 'self:layers=N' runs the "
                "target's own weights"
            )
        return early_exit_draft(target, int(match.group(1)))
    draft = load_model(spec, dtype, quantization)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"draft_model {spec!r} has a vocabulary of {draft.config.vocab_size} tokens; the "
            f"target's has {target.config.vocab_size}: they must share one"
        )
    return DraftModel(draft.model, draft.config, shares_target_kv=False)


def early_exit_draft(target: LoadedModel, num_layers: int) -> DraftModel:
    """The target's first `num_layers` layers with its norm and head, sharing its weights."""
    total = target.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"draft_model 'self:layers=N' needs 1 <= N < {total} (the target's layers), "
            f"got {num_layers}"
        )
    config = _with_layers(target.config, num_layers)
    with torch.device("meta"):
        model = build_model(config)
    source = target.model
    model.embed_tokens = source.embed_tokens
    model.layers = nn.ModuleList(source.layers[:num_layers])
    model.norm = source.norm
    model.lm_head = source.lm_head
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(
            f"draft_model 'self:layers=N' is not supported for {target.config.architecture}"
        )
    return DraftModel(model.eval(), config, shares_target_kv=True)


def _with_layers(config: ModelConfig, num_layers: int) -> ModelConfig:
    fields = {**config.__dict__, "num_hidden_layers": num_layers}
    if config.layer_types is not None:
        fields["layer_types"] = config.layer_types[:num_layers]
    return ModelConfig(**fields)


class DraftModelProposer:
    def __init__(
        self,
        draft: DraftModel,
        kv_caches: list[KVCache],
        block_size: int,
        native_decode_loop: bool = True,
        sample_drafts: bool = False,
    ) -> None:
        """`sample_drafts`: draw a sampled request's drafts from the draft model's distribution
        (adjusted by the request's own sampling settings) instead of taking its argmax."""
        self.draft = draft
        self.kv_caches = kv_caches
        # An early exit's KV is the target's own layers, which copy-on-write already reaches.
        self.own_kv_caches: list[KVCache] = [] if draft.shares_target_kv else list(kv_caches)
        self.block_size = block_size
        self.decode_loop = (
            NativeDecodeLoop.build(draft.model, kv_caches) if native_decode_loop else None
        )
        self.sample_drafts = sample_drafts
        self._last: dict[str, _Drafted] = {}  # what each request drafted last step

    def propose(
        self,
        scheduled: Sequence[ScheduledRequest],
        emitted: Mapping[str, list[int]],
        hidden: torch.Tensor,
    ) -> dict[str, list[int]]:
        chunks = [chunk for item in scheduled if (chunk := self._catch_up(item, emitted))]
        drafting = [chunk for chunk in chunks if chunk.num_to_draft]
        self._last = {c.request_id: _Drafted(c.end, c.block_ids) for c in drafting}
        if not chunks or (self.draft.shares_target_kv and not drafting):
            return {}
        items = {item.request.request_id: item for item in scheduled}
        with torch.inference_mode():
            while chunks:
                # The first pass catches up on real tokens; later ones feed the drafts back.
                logits = self._forward(chunks)
                chunks = [chunk for chunk in chunks if chunk.num_to_draft]
                tokens = self._choose(chunks, logits, items, emitted)
                for chunk, token in zip(chunks, tokens, strict=True):
                    self._last[chunk.request_id].token_ids.append(token)
                chunks = [
                    chunk.next_draft(token)
                    for chunk, token in zip(chunks, tokens, strict=True)
                    if len(self._last[chunk.request_id].token_ids) < chunk.num_to_draft
                ]
        return {request_id: last.token_ids for request_id, last in self._last.items()}

    def draft_parents(self, request_id: str) -> None:
        """A draft model drafts chains."""
        return None

    def draft_probs(self, request_id: str, draft_token_ids: Sequence[int]) -> torch.Tensor | None:
        """The distributions of the request's drawn drafts; None for argmax drafts, or when the
        drafts are not a prefix of what the last step proposed (then the rejection sampler
        treats them as one-hot, which is exact however a draft was chosen)."""
        last = self._last.get(request_id)
        num = len(draft_token_ids)
        if (
            last is None
            or num > len(last.drawn_from)
            or list(draft_token_ids) != last.token_ids[:num]
        ):
            return None
        return torch.stack(last.drawn_from[:num])

    def _choose(
        self,
        chunks: Sequence[_Chunk],
        logits: torch.Tensor,
        items: Mapping[str, ScheduledRequest],
        emitted: Mapping[str, list[int]],
    ) -> list[int]:
        """Each drafting chunk's next draft: the draft model's argmax, or with `sample_drafts` a
        sampled request's draw from the draft's distribution under that request's sampling
        settings and history, as the target will score it (the distribution is kept for the
        rejection sampler)."""
        tokens = ops.row_argmax(logits).tolist()
        if not self.sample_drafts:
            return tokens
        drawn = [i for i, c in enumerate(chunks) if not items[c.request_id].request.params.greedy]
        if not drawn:
            return tokens
        rows = []
        for i in drawn:
            chunk = chunks[i]
            request = items[chunk.request_id].request
            history = [
                *request.output_token_ids,
                *emitted.get(chunk.request_id, []),
                *self._last[chunk.request_id].token_ids,
            ]
            rows.append(
                SamplingRow(
                    params=request.params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=history,
                    generator=_draft_generator(request.params.seed, chunk.end),
                    eos_token_ids=request.eos_token_ids,
                )
            )
        probs = sampling_probs(adjust_logits(logits[drawn], rows), rows)
        for i, row, dist in zip(drawn, rows, probs, strict=True):
            tokens[i] = int(torch.multinomial(dist, 1, generator=row.generator))
            self._last[chunks[i].request_id].drawn_from.append(dist)
        return tokens

    def _catch_up(self, item: ScheduledRequest, emitted: Mapping[str, list[int]]) -> _Chunk | None:
        """The real tokens the draft must compute this step: those the target computed whose
        draft KV is not already right (none when their KV is the target's), plus the newest
        token when the request drafts."""
        gained = emitted.get(item.request.request_id, [])
        computed = num_computed_after(item, gained)
        num_to_draft = item.num_tokens_to_draft if gained else 0
        if self.draft.shares_target_kv:
            start = computed
        else:
            start = self._first_stale_position(item, gained)
        end = computed + (1 if num_to_draft else 0)
        if end <= start:
            return None
        tokens = token_ids_between(item, gained, start, end)
        return _Chunk(item.request.request_id, item.block_ids, start, end, tokens, num_to_draft)

    def _first_stale_position(self, item: ScheduledRequest, gained: Sequence[int]) -> int:
        """Where the draft's own KV stops being right. Feeding its drafts back last step wrote
        their KV; each is right if it and every draft before it equal the tokens the target
        accepted. Otherwise (or without last step's record: preempted, just admitted) from the
        first token the target computed this step."""
        last = self._last.get(item.request.request_id)
        if last is None or item.num_computed_tokens != last.first_position - 1:
            return item.num_computed_tokens
        num_right = 0
        fed = last.token_ids[:-1]  # the last draft is never fed back
        for draft, token in zip(fed, gained, strict=False):
            if draft != token:
                break
            num_right += 1
        stale = last.first_position + num_right
        num_blocks = -(-stale // self.block_size)
        if item.block_ids[:num_blocks] != last.block_ids[:num_blocks]:
            return item.num_computed_tokens
        return stale

    def _forward(self, chunks: Sequence[_Chunk]) -> torch.Tensor:
        """Run the draft over the chunks; logits at the last token of each chunk that drafts."""
        ids, positions, meta, rows = paged_chunk_batch(
            chunks, [c.token_ids for c in chunks], self.block_size
        )
        hidden = run_step(self.draft.model, self.decode_loop, ids, positions, self.kv_caches, meta)
        return self.draft.model.compute_logits(hidden[rows])


def _draft_generator(seed: int | None, position: int) -> torch.Generator | None:
    """A seeded request's drafts come from a generator of its own seed and the draft's
    position, so a rerun drafts, and so emits, the same; None uses the global RNG."""
    return make_generator(None if seed is None else (seed * 1_000_003 + position) % 2**63)


class PagedChunk(Protocol):
    """Positions [start, end) of one request that a drafter runs, through its block table."""

    block_ids: list[int]
    start: int
    end: int
    num_to_draft: int


def paged_chunk_batch(
    chunks: Sequence[PagedChunk], token_ids: Sequence[list[int]], block_size: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The drafters' flat batch: input ids (`token_ids[i]` for chunk i), their positions, the
    attention layout writing KV through each chunk's blocks, and the rows of the chunks that
    draft (each one's last token)."""
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    for chunk, chunk_ids in zip(chunks, token_ids, strict=True):
        ids += chunk_ids
        positions += range(chunk.start, chunk.end)
        slots += slot_mapping(chunk.block_ids, block_size, chunk.start, chunk.end)
        if chunk.num_to_draft:
            rows.append(len(positions) - 1)
    meta = AttentionMetadata.build(
        query_lens=[c.end - c.start for c in chunks],
        seq_lens=[c.end for c in chunks],
        block_tables=[c.block_ids for c in chunks],
        block_size=block_size,
        slot_mapping=slots,
    )
    as_long = (torch.tensor(x, dtype=torch.long) for x in (ids, positions, rows))
    input_ids, input_positions, drafting_rows = as_long
    return input_ids, input_positions, meta, drafting_rows


@dataclass
class _Drafted:
    """A request's drafts of one step, at positions first_position on (all but the last fed
    back through the draft model, writing their KV), and for drawn drafts the distributions
    they came from."""

    first_position: int
    block_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    drawn_from: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Chunk:
    request_id: str
    block_ids: list[int]
    start: int
    end: int
    token_ids: list[int]
    num_to_draft: int

    def next_draft(self, token: int) -> _Chunk:
        """The one-token chunk that feeds the latest draft back in."""
        return _Chunk(
            self.request_id, self.block_ids, self.end, self.end + 1, [token], self.num_to_draft
        )
