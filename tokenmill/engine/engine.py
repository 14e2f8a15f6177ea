"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time.

A step is three calls in one direction: `scheduler.schedule()` -> `runner.execute()` ->
`scheduler.update()`; the output processor then turns the new tokens into text and reports the
stop strings it finds, which the scheduler (the one owner of a request's end) applies.

A request with structured outputs waits outside the scheduler until its grammar has compiled
(in the background; others keep decoding meanwhile); the structured-output manager then follows
its accepted tokens and reports when its grammar has ended.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from concurrent.futures import wait
from typing import Any

from tokenmill.config import EngineArgs, ModelConfig, parse_dtype
from tokenmill.engine.admission import make_admission_policy
from tokenmill.engine.disk_tier_setup import open_disk_tier
from tokenmill.engine.host_memory import reuse_freed_memory
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.kv.groups import kv_groups
from tokenmill.kv.layout import allocate_kv_caches, kv_block_bytes, kv_bytes_per_token
from tokenmill.kv.managers import make_kv_manager
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.request import FinishReason, Request
from tokenmill.sampling.params import SamplingParams
from tokenmill.spec.setup import build_proposer, load_draft, speculation_policy
from tokenmill.structured.manager import StructuredOutputManager

GRAMMAR_WAIT_S = 0.05
"""How long an otherwise idle step waits for a grammar to compile before returning."""

PromptInput = str | list[int] | Mapping[str, Any]


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines (say, one per KV mode) share one loaded model."""
        self.args = args
        if args.reuse_host_memory:
            reuse_freed_memory()
        dtype = parse_dtype(args.dtype)
        self.loaded = loaded or load_model(args.model, dtype, args.quantization)
        self.tokenizer = self.loaded.tokenizer
        config = self.loaded.config
        self.max_model_len = min(
            args.max_model_len or config.max_position_embeddings, config.max_position_embeddings
        )
        draft = load_draft(args, self.loaded, dtype, self.max_model_len)
        draft_bytes_per_token = 0 if draft is None else draft.kv_bytes_per_token(dtype)
        self.kv_bytes_per_token = (
            kv_bytes_per_token(config, dtype, args.kv_cache_dtype) + draft_bytes_per_token
        )
        self.kv_groups = kv_groups(config, _trims_windows(args, config, draft))
        self.kv_block_bytes = (
            kv_block_bytes(config, dtype, args.block_size, args.kv_cache_dtype, self.kv_groups)
            + draft_bytes_per_token * args.block_size
        )
        self.num_blocks = int(args.kv_cache_memory) // self.kv_block_bytes
        self.disk_tier = open_disk_tier(args, self.loaded, self.kv_groups, self.kv_block_bytes)
        self.kv_manager = make_kv_manager(
            args.kv_cache,
            self.num_blocks,
            args.block_size,
            args.enable_prefix_caching,
            self.max_model_len,
            self.kv_groups,
            args.max_num_batched_tokens if args.enable_chunked_prefill else None,
            cache_ttl_s=args.prefix_cache_ttl,
            max_retained_fraction=args.max_retained_kv_fraction,
            disk_tier=self.disk_tier,
        )
        capacity = self.kv_manager.max_tokens_per_request
        self.max_seq_len = (
            self.max_model_len if capacity is None else min(self.max_model_len, capacity)
        )
        kv_caches = None
        if self.kv_manager.holds_kv:
            kv_caches = allocate_kv_caches(
                config, self.num_blocks, args.block_size, dtype, args.kv_cache_dtype, self.kv_groups
            )
        self.scheduler = Scheduler(
            self.kv_manager,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            admission=make_admission_policy(args.scheduler, args.max_num_seqs, args.max_wait_ms),
            speculation=speculation_policy(args),
        )
        proposer = build_proposer(args, draft, kv_caches, self.num_blocks)
        self.structured = StructuredOutputManager(
            self.tokenizer, config.vocab_size, args.overlap_grammar_masks
        )
        self._awaiting_grammar: list[Request] = []  # constrained requests still compiling
        self.runner = ModelRunner(
            self.loaded.model,
            kv_caches,
            args.block_size,
            proposer=proposer,
            native_decode_loop=args.decode_loop == "native",
            prepack_batch_hint=args.prepack_batch_hint,
            disk_tier=self.disk_tier,
            layer_groups=self.kv_groups.group_of,
            structured=self.structured,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.last_step_num_requests = 0  # requests the latest step computed (its batch size)
        self._closed = False

    @property
    def kv_cache_bytes(self) -> int:
        """Memory of the allocated KV pool (0 without a KV cache)."""
        return self.num_blocks * self.kv_block_bytes if self.kv_manager.holds_kv else 0

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        if self.output_processor.child_ids(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = params or SamplingParams()
        text, token_ids = self._tokenize(prompt)
        self._check_fits(token_ids)
        spec = params.structured_outputs
        if spec is not None:
            grammar = self.structured.compile(spec)
            if grammar.done() and grammar.exception() is not None:
                raise grammar.exception()  # type: ignore[misc]
        children = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                prompt_token_ids=token_ids,
                params=_child_params(params, index),
                eos_token_ids=self.tokenizer.stop_token_ids,
                priority=priority,
                max_model_len=self.max_seq_len,
            )
            for index in range(params.n)
        ]
        for sibling in children[1:]:  # they fork the first one's prompt KV (see Scheduler)
            sibling.parent_request_id = children[0].request_id
        self.output_processor.add(request_id, text, children)
        if spec is not None:
            self._awaiting_grammar += children
        else:
            for child in children:
                self.scheduler.add_request(child)

    def step(self) -> list[RequestOutput]:
        failed = self._schedule_compiled_requests()
        scheduled = self.scheduler.schedule()
        self.last_step_num_requests = len(scheduled.scheduled)
        result = self.runner.execute(scheduled)
        self.scheduler.update(
            scheduled,
            result.sampled,
            result.proposed,
            result.verify_time_s,
            result.draft_time_s,
            result.proposed_parents,
        )
        self.output_processor.add_prompt_logprobs(result.prompt_logprobs)
        progressed = [
            s.request for s in scheduled.scheduled if s.request.request_id in result.sampled
        ]
        for request in self.structured.accept(progressed):
            self.scheduler.stop_at_grammar_end(request)
        for hit in self.output_processor.update_text(progressed, result.logprobs):
            self.scheduler.stop_at_string(hit.request, hit.num_output_tokens, hit.stop)
        for request in progressed:
            if request.is_finished:
                self.runner.release(request.request_id)
                self.structured.release(request.request_id)
        return self.output_processor.outputs(failed + progressed)

    def _schedule_compiled_requests(self) -> list[Request]:
        """Hand the scheduler the waiting requests whose grammar has compiled, and those whose
        grammar failed to compile for it to abort at once (returned). With nothing else to run,
        wait briefly for a grammar rather than spin."""
        if not self._awaiting_grammar:
            return []
        grammars = {
            r.request_id: self.structured.compile(r.params.structured_outputs)  # type: ignore[arg-type]
            for r in self._awaiting_grammar
        }
        if not self.scheduler.has_unfinished_requests():
            wait(grammars.values(), timeout=GRAMMAR_WAIT_S, return_when="FIRST_COMPLETED")
        failed, still_waiting = [], []
        for request in self._awaiting_grammar:
            grammar = grammars[request.request_id]
            if not grammar.done():
                still_waiting.append(request)
            elif grammar.exception() is not None:
                self.scheduler.add_request(request)
                self.scheduler.finish_requests([request.request_id], FinishReason.ABORT)
                failed.append(request)
            else:
                self.structured.start(request, grammar.result())
                self.scheduler.add_request(request)
        self._awaiting_grammar = still_waiting
        return failed

    def abort_request(self, request_id: str | list[str]) -> None:
        """Cancel requests (by the id given to add_request); their blocks are freed at once."""
        ids = [request_id] if isinstance(request_id, str) else request_id
        for parent_id in ids:
            children = self.output_processor.child_ids(parent_id)
            self.scheduler.finish_requests(children, FinishReason.ABORT)
            self._awaiting_grammar = [
                r for r in self._awaiting_grammar if r.request_id not in children
            ]
            for child in children:
                self.runner.release(child)
                self.structured.release(child)
            self.output_processor.drop(parent_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._awaiting_grammar)

    def close(self) -> None:
        """A clean shutdown, between steps, after which the engine is not stepped again: every
        cached full block the disk tier lacks is written, and the writes are waited for."""
        if self.disk_tier is None or self._closed:
            return
        self._closed = True
        self.runner.transfer_tier_blocks(self.kv_manager.blocks_to_persist(), [])
        self.disk_tier.close()

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError("prompt must hold 'prompt' (str) or 'prompt_token_ids' (list of int)")
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise ValueError(f"prompt must be a str, a list of token ids or a dict, got {prompt!r}")

    def _check_ids(self, token_ids: object) -> list[int]:
        vocab = self.loaded.config.vocab_size
        if not isinstance(token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids
        ):
            raise ValueError(f"prompt_token_ids must be a list of ints in [0, {vocab})")
        return token_ids

    def _check_fits(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must contain at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but the model's context length is "
                f"{self.max_model_len}: at most {self.max_model_len - 1} prompt tokens fit"
            )
        if len(token_ids) >= self.max_seq_len:
            raise ValueError(
                f"the KV cache holds {self.max_seq_len} tokens, too few for this "
                f"{len(token_ids)}-token prompt; raise kv_cache_memory or lower max_model_len"
            )


def _trims_windows(args: EngineArgs, config: ModelConfig, draft: Any) -> bool:
    """Whether sliding-window layers keep only their window's blocks. Not with an early-exit
    draft, which writes the target's first layers through one table; nor with a drafter of its
    own KV when no layer attends to everything: that KV rides on the first group's table, which
    would then drop blocks the drafter still reads."""
    if not (args.kv_window_trimming and args.kv_cache == "paged"):
        return False
    if draft is None:
        return True
    return not draft.shares_target_kv and None in config.layer_windows


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Each of the n samples gets its own seed (seed + index), so seeded samples differ. Only
    the first (the parent, which computes the prompt the others fork) scores the prompt."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    prompt_logprobs = params.prompt_logprobs if index == 0 else None
    return dataclasses.replace(params, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
