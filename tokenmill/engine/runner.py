"""The model runner: the one place where scheduled requests become tensors.

Each step it lays the scheduled tokens of all requests end to end (no padding), tells attention
where their keys and values go, runs the model once, and samples a token for every request
whose known tokens are now all computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.engine.scheduler import ScheduledRequest, SchedulerOutput
from tokenmill.model.attention import AttentionMetadata
from tokenmill.sampling.sampler import Sampler, SamplingRow, TokenLogprobs, make_generator


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


def allocate_kv_caches(
    config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x element size."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor] | None,
        block_size: int,
    ) -> None:
        """`kv_caches=None` runs without a KV cache: the scheduler then sends whole sequences."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator | None] = {}

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if not out.scheduled:
            return RunnerOutput()
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for item in out.scheduled:
            start = item.num_computed_tokens
            stop = start + item.num_new_tokens
            input_ids += item.request.all_token_ids[start:stop]
            positions += range(start, stop)
            if self.kv_caches is not None:
                slots += self._slots(item.block_ids, start, stop)
        meta = AttentionMetadata.build(
            query_lens=[s.num_new_tokens for s in out.scheduled],
            seq_lens=[s.num_computed_tokens + s.num_new_tokens for s in out.scheduled],
            block_tables=None if self.kv_caches is None else [s.block_ids for s in out.scheduled],
            block_size=self.block_size,
            slot_mapping=None if self.kv_caches is None else slots,
        )
        sampling = [s for s in out.scheduled if s.samples]
        with torch.inference_mode():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long),
                torch.tensor(positions, dtype=torch.long),
                self.kv_caches,
                meta,
            )
            if not sampling:
                return RunnerOutput()
            last_rows = self._last_token_rows(out.scheduled)
            logits = self.model.compute_logits(hidden[last_rows])
            result = self.sampler(logits, [self._sampling_row(s) for s in sampling])
        output = RunnerOutput()
        for item, token, logprobs in zip(sampling, result.token_ids, result.logprobs, strict=True):
            output.sampled[item.request.request_id] = token
            if logprobs is not None:
                output.logprobs[item.request.request_id] = logprobs
        return output

    def release(self, request_id: str) -> None:
        """Forget a finished request's random generator."""
        self._generators.pop(request_id, None)

    def _slots(self, block_ids: list[int], start: int, stop: int) -> list[int]:
        size = self.block_size
        return [block_ids[p // size] * size + p % size for p in range(start, stop)]

    @staticmethod
    def _last_token_rows(scheduled: list[ScheduledRequest]) -> torch.Tensor:
        rows, end = [], 0
        for item in scheduled:
            end += item.num_new_tokens
            if item.samples:
                rows.append(end - 1)
        return torch.tensor(rows, dtype=torch.long)

    def _sampling_row(self, item: ScheduledRequest) -> SamplingRow:
        request = item.request
        if request.request_id not in self._generators:
            self._generators[request.request_id] = make_generator(request.params.seed)
        return SamplingRow(
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
            generator=self._generators[request.request_id],
            eos_token_ids=request.eos_token_ids,
        )
