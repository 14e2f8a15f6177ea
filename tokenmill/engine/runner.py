"""The model runner: the one place where scheduled requests become tensors.

Each step it lays the scheduled tokens of all requests end to end (no padding), tells attention
where their keys and values go, runs the model once, and samples a token for every request
whose known tokens are now all computed. With speculative decoding, a request's chunk ends with
its drafts; the rejection sampler then decides how many to keep, and the proposer drafts the
next ones. Rows of requests with structured outputs get their grammar's token mask before
sampling (or verification, where each draft's row is masked as if the drafts before it were
accepted); the mask is started before the forward pass, which it does not depend on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.draft_tree import depths, is_chain, path_to, tree_parents
from tokenmill.kv.block_pool import BlockHash, EvictedBlock
from tokenmill.kv.disk_tier import DiskTier
from tokenmill.kv.layout import slot_mapping
from tokenmill.kv.quantized import KVCache, copy_cache_blocks, copy_slots, slot_views
from tokenmill.model.attention import AttentionMetadata, GroupedAttentionMetadata, StepMetadata
from tokenmill.model.decode_loop import NativeDecodeLoop, run_step
from tokenmill.quant.prepare import prepare_weights
from tokenmill.sampling.sampler import (
    Sampler,
    SamplingRow,
    TokenLogprobs,
    make_generator,
    token_logprobs,
)
from tokenmill.scheduler_output import ScheduledRequest, SchedulerOutput
from tokenmill.spec.proposer import Proposer
from tokenmill.spec.rejection import DraftsToVerify, RejectionSampler
from tokenmill.spec.tree import accepted_drafts
from tokenmill.structured.manager import StructuredOutputManager

PROMPT_LOGPROBS_ROWS = 256
"""Prompt positions scored per lm_head call: bounds the [rows, vocab] logits of a long prompt."""


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)  # new tokens, in order
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # one per new token
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    proposed: dict[str, list[int]] = field(default_factory=dict)  # drafts for the next step
    proposed_parents: dict[str, list[int]] = field(default_factory=dict)  # trees among them
    verify_time_s: float = 0.0  # the target's forward pass and sampling
    draft_time_s: float = 0.0  # the proposer


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[KVCache] | None,
        block_size: int,
        proposer: Proposer | None = None,
        native_decode_loop: bool = True,
        prepack_batch_hint: int | None = None,
        disk_tier: DiskTier | None = None,
        layer_groups: tuple[int, ...] | None = None,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        """`kv_caches=None` runs without a KV cache: the scheduler then sends whole sequences.
        `native_decode_loop`: run decode steps' layers in one native call where the model and
        its weights allow (tokenmill/model/decode_loop.py).
        `prepack_batch_hint`: lay the float weights out for batched products of about that many
        rows (`Linear.prepack`); None keeps only the plain weights.
        `structured`: the grammar matchers whose token masks constrain their requests' rows."""
        prepare_weights(model, prepack_batch_hint)
        self.model = model
        self.kv_caches = kv_caches
        self.decode_loop = NativeDecodeLoop.build(model, kv_caches) if native_decode_loop else None
        self.layer_groups = layer_groups
        # Every cache a copy-on-write must reach, once each (layers of different KV-cache groups
        # share slot tensors): the target's and a drafter's own.
        caches = [*(kv_caches or ()), *(proposer.own_kv_caches if proposer else ())]
        self.paged_caches = list({id(cache): cache for cache in caches}.values())
        self.block_size = block_size
        self.disk_tier = disk_tier
        self.sampler = Sampler()
        self.rejection_sampler = RejectionSampler()
        self.proposer = proposer
        self.structured = structured
        self._generators: dict[str, torch.Generator | None] = {}
        self._prompt_logprobs_done: dict[str, int] = {}  # prompt positions already scored
        # What a KV move copies in: each distinct (cache, group) of the target's layers, as the
        # cache's slot views and the group (a cache shared by layers of one group moves once).
        self._move_targets: list[tuple[list[torch.Tensor], int]] = []
        seen: set[tuple[int, int]] = set()
        for layer, cache in enumerate(kv_caches or ()):
            group = layer_groups[layer] if layer_groups else 0
            if (id(cache), group) not in seen:
                seen.add((id(cache), group))
                self._move_targets.append((slot_views(cache), group))

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if out.kv_saves or out.kv_loads:
            self.transfer_tier_blocks(out.kv_saves, out.kv_loads)
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        if not out.scheduled:
            return RunnerOutput()
        input_ids: list[int] = []
        positions: list[int] = []
        start_time = time.perf_counter()
        for item in out.scheduled:
            start = item.num_computed_tokens
            stop = start + item.num_new_tokens
            input_ids += item.request.all_token_ids[start:stop]
            input_ids += item.spec_token_ids
            positions += _positions(item)
        meta = self._attention_metadata(out.scheduled)
        sampling = [s for s in out.scheduled if s.samples]
        if self.structured is not None:
            self.structured.start_masks(sampling)  # filled while the forward pass runs
        with torch.inference_mode():
            # One tensor, two contiguous rows: a single conversion from Python for both.
            ids_and_positions = torch.tensor([input_ids, positions], dtype=torch.long)
            hidden = self._forward(ids_and_positions[0], ids_and_positions[1], meta)
            output = RunnerOutput(prompt_logprobs=self._prompt_logprobs(out.scheduled, hidden))
            if sampling:
                rows = self._sampling_rows(out.scheduled)
                logits = self.model.compute_logits(hidden if rows is None else hidden[rows])
                if self.structured is not None:
                    self.structured.apply_masks(logits)
                self._sample(sampling, logits, output)
                self._keep_accepted_paths(out.scheduled, output.sampled, hidden)
            output.verify_time_s = time.perf_counter() - start_time
            if self.proposer is not None:
                start_time = time.perf_counter()
                output.proposed = self.proposer.propose(out.scheduled, output.sampled, hidden)
                output.proposed_parents = self._proposed_trees(output.proposed)
                output.draft_time_s = time.perf_counter() - start_time
        return output

    def _attention_metadata(self, scheduled: list[ScheduledRequest]) -> StepMetadata:
        """The batch's layout: one per KV-cache group, each with its own slots and tables."""
        query_lens = [s.num_new_tokens for s in scheduled]
        seq_lens = [s.num_computed_tokens + s.num_new_tokens for s in scheduled]
        trees = [s.spec_parents for s in scheduled]
        if self.kv_caches is None:
            return AttentionMetadata.build(query_lens, seq_lens, None, self.block_size, None)
        per_group = []
        for g in range(len(scheduled[0].block_tables)):
            tables = [item.block_tables[g] for item in scheduled]
            slots: list[int] = []
            for item, table in zip(scheduled, tables, strict=True):
                start = item.num_computed_tokens
                slots += slot_mapping(table, self.block_size, start, start + item.num_new_tokens)
            per_group.append(
                AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, slots, trees)
            )
        if len(per_group) == 1:
            return per_group[0]
        assert self.layer_groups is not None, "a runner for KV-cache groups needs layer_groups"
        return GroupedAttentionMetadata(tuple(per_group), self.layer_groups)

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        return run_step(self.model, self.decode_loop, input_ids, positions, self.kv_caches, meta)

    def _sample(
        self, sampling: list[ScheduledRequest], logits: torch.Tensor, output: RunnerOutput
    ) -> None:
        """`logits` holds one row per sampling request, or k + 1 rows for one with k drafts."""
        plain, plain_rows, speculative, speculative_rows = [], [], [], []
        row = 0
        for item in sampling:
            num_rows = 1 + len(item.spec_token_ids)
            if item.spec_token_ids:
                speculative.append(item)
                speculative_rows += range(row, row + num_rows)
            else:
                plain.append(item)
                plain_rows.append(row)
            row += num_rows
        # When one kind has every row, in order, indexing would only copy them.
        if plain:
            plain_logits = logits if not speculative else logits[plain_rows]
            self._sample_plain(plain, plain_logits, output)
        if speculative:
            speculative_logits = logits if not plain else logits[speculative_rows]
            self._verify_drafts(speculative, speculative_logits, output)

    def _sample_plain(
        self, items: list[ScheduledRequest], logits: torch.Tensor, output: RunnerOutput
    ) -> None:
        result = self.sampler(logits, [self._sampling_row(item) for item in items])
        for item, token, logprobs in zip(items, result.token_ids, result.logprobs, strict=True):
            output.sampled[item.request.request_id] = [token]
            if logprobs is not None:
                output.logprobs[item.request.request_id] = [logprobs]

    def _verify_drafts(
        self, items: list[ScheduledRequest], logits: torch.Tensor, output: RunnerOutput
    ) -> None:
        """`logits`: k + 1 rows per request, the target's view of its last token and drafts."""
        batch = [
            DraftsToVerify(
                item.spec_token_ids,
                self._verify_rows(item),
                self._draft_probs(item),
                item.spec_parents,
            )
            for item in items
        ]
        row = 0
        for item, tokens in zip(items, self.rejection_sampler(logits, batch), strict=True):
            request = item.request
            output.sampled[request.request_id] = tokens
            if request.params.logprobs is not None:
                num_top = [request.params.logprobs] * len(tokens)
                accepted = _accepted(item, tokens)
                rows = [row, *(row + 1 + i for i in accepted)]
                output.logprobs[request.request_id] = token_logprobs(logits[rows], tokens, num_top)
            row += 1 + len(item.spec_token_ids)

    def _keep_accepted_paths(
        self, scheduled: list[ScheduledRequest], sampled: dict[str, list[int]], hidden: torch.Tensor
    ) -> None:
        """Move each verified tree's accepted path to where a chain's drafts sit, its KV and
        its hidden states alike: the scheduler then keeps KV up to the last accepted draft, and
        the proposer reads the path's features in order, as after a chain."""
        moves: list[tuple[ScheduledRequest, int, int]] = []  # (request, from index, to index)
        hidden_src: list[int] = []
        hidden_dst: list[int] = []
        base = 0
        for item in scheduled:
            tokens = sampled.get(item.request.request_id)
            if tokens and item.spec_parents and not is_chain(item.spec_parents):
                root = item.num_computed_tokens + item.num_new_tokens - len(item.spec_token_ids) - 1
                for depth, draft in enumerate(_accepted(item, tokens), start=1):
                    if draft + 1 != depth:
                        moves.append((item, root + 1 + draft, root + depth))
                        hidden_src.append(base + root + 1 + draft - item.num_computed_tokens)
                        hidden_dst.append(base + root + depth - item.num_computed_tokens)
            base += item.num_new_tokens
        if not moves:
            return
        src, dst = torch.tensor(hidden_src), torch.tensor(hidden_dst)
        hidden.index_copy_(0, dst, hidden.index_select(0, src))
        self._move_kv(moves)

    def _move_kv(self, moves: list[tuple[ScheduledRequest, int, int]]) -> None:
        """Copy each (request, from index, to index) position's KV in every target layer,
        through the request's table of that layer's group."""
        assert self.kv_caches is not None
        num_groups = len(moves[0][0].block_tables)
        slots = []
        for g in range(num_groups):
            pairs = [
                (
                    _slot(item.block_tables[g], a, self.block_size),
                    _slot(item.block_tables[g], b, self.block_size),
                )
                for item, a, b in moves
            ]
            slots.append(tuple(torch.tensor(side) for side in zip(*pairs, strict=True)))
        for views, group in self._move_targets:
            copy_slots(views, *slots[group])

    def _proposed_trees(self, proposed: dict[str, list[int]]) -> dict[str, list[int]]:
        """The parents of each proposal that is a tree."""
        assert self.proposer is not None
        trees = {}
        for request_id in proposed:
            parents = self.proposer.draft_parents(request_id)
            if parents:
                trees[request_id] = parents
        return trees

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: each (src, dst) block's K and V (and a quantized cache's scales), in
        every layer of every paged cache, by one index copy per tensor. The sources are gathered
        before any destination is written."""
        src = torch.tensor([pair[0] for pair in copies], dtype=torch.long)
        dst = torch.tensor([pair[1] for pair in copies], dtype=torch.long)
        for cache in self.paged_caches:
            copy_cache_blocks(cache, src, dst)

    def transfer_tier_blocks(
        self, saves: list[EvictedBlock], loads: list[tuple[BlockHash, int]]
    ) -> None:
        """Save evicted blocks' KV first (their slots may be this step's load targets), then
        load the disk hits."""
        assert self.disk_tier is not None
        self.disk_tier.save(self.paged_caches, saves)
        self.disk_tier.load(self.paged_caches, loads)

    def release(self, request_id: str) -> None:
        """Forget a finished request's random generator and prompt-logprob progress."""
        self._generators.pop(request_id, None)
        self._prompt_logprobs_done.pop(request_id, None)

    def _prompt_logprobs(
        self, scheduled: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, list[TokenLogprobs]]:
        """Score the prompt tokens this step's chunks predict: position p's logits give prompt
        token p + 1. Positions scored before a preemption (or by an earlier full recompute
        without a KV cache) are not scored twice."""
        result: dict[str, list[TokenLogprobs]] = {}
        first_row = 0
        for item in scheduled:
            request, chunk_start = item.request, item.num_computed_tokens
            rows_start, first_row = first_row, first_row + item.num_new_tokens
            num_top = request.params.prompt_logprobs
            if num_top is None:
                continue
            start = max(chunk_start, self._prompt_logprobs_done.get(request.request_id, 0))
            stop = min(chunk_start + item.num_new_tokens, request.num_prompt_tokens - 1)
            if start >= stop:
                continue
            entries: list[TokenLogprobs] = []
            for lo in range(start, stop, PROMPT_LOGPROBS_ROWS):
                hi = min(lo + PROMPT_LOGPROBS_ROWS, stop)
                rows = hidden[rows_start + lo - chunk_start : rows_start + hi - chunk_start]
                targets = request.prompt_token_ids[lo + 1 : hi + 1]
                logits = self.model.compute_logits(rows)
                entries += token_logprobs(logits, targets, [num_top] * len(targets))
            self._prompt_logprobs_done[request.request_id] = stop
            result[request.request_id] = entries
        return result

    @staticmethod
    def _sampling_rows(scheduled: list[ScheduledRequest]) -> torch.Tensor | None:
        """Rows of the flat batch whose logits are needed: each sampling request's last token
        and its drafts. None when that is every row, in order (decodes and verify chunks), so
        the hidden states are used as they are."""
        rows: list[int] = []
        end = 0
        for item in scheduled:
            end += item.num_new_tokens
            if item.samples:
                rows += range(end - 1 - len(item.spec_token_ids), end)
        if len(rows) == end:
            return None
        return torch.tensor(rows, dtype=torch.long)

    def _sampling_row(
        self, item: ScheduledRequest, drafts_before: tuple[int, ...] = ()
    ) -> SamplingRow:
        """The row of the request's next token, or of the token after `drafts_before` (which
        then count as output for penalties and min_tokens)."""
        request = item.request
        if request.request_id not in self._generators:
            self._generators[request.request_id] = make_generator(request.params.seed)
        output = request.output_token_ids
        return SamplingRow(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=[*output, *drafts_before] if drafts_before else output,
            generator=self._generators[request.request_id],
            eos_token_ids=request.eos_token_ids,
        )

    def _draft_probs(self, item: ScheduledRequest) -> torch.Tensor | None:
        if self.proposer is None:
            return None
        return self.proposer.draft_probs(item.request.request_id, item.spec_token_ids)

    def _verify_rows(self, item: ScheduledRequest) -> list[SamplingRow]:
        """One row for the root and one after each draft, whose history holds the drafts on
        its path (for a chain, every draft before it)."""
        drafts = item.spec_token_ids
        params, output = item.request.params, item.request.output_token_ids
        if not params.uses_penalties and len(output) >= params.min_tokens:
            # A history counts only for penalties and min_tokens: one row serves every position.
            return [self._sampling_row(item)] * (len(drafts) + 1)
        parents = tree_parents(item.spec_parents, len(drafts))
        paths = [(), *(tuple(drafts[i] for i in path_to(parents, d)) for d in range(len(drafts)))]
        return [self._sampling_row(item, path) for path in paths]


def _positions(item: ScheduledRequest) -> list[int]:
    """Positions of the request's chunk: in order, except a draft tree's, each at its depth."""
    start, stop = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
    if not item.spec_parents:
        return list(range(start, stop))
    root = stop - len(item.spec_token_ids) - 1
    return [*range(start, root + 1), *(root + d for d in depths(item.spec_parents))]


def _accepted(item: ScheduledRequest, tokens: list[int]) -> list[int]:
    """The drafts a verification accepted (a chain's first ones, or a tree's path)."""
    if not item.spec_parents:
        return list(range(len(tokens) - 1))
    return accepted_drafts(item.spec_parents, item.spec_token_ids, tokens)


def _slot(block_table: list[int], index: int, block_size: int) -> int:
    return block_table[index // block_size] * block_size + index % block_size
