"""How big each ablate experiment is: `FULL`, the run docs/benchmarks.md reports, and
`QUICK`, every experiment shrunk to a few tokens."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.bench.workloads import RequestShape


@dataclass(frozen=True)
class AblateSizes:
    """How big each experiment is. The batch workload is `random_requests(1, ...)`, which with
    the full sizes is exactly batch64."""

    kv_prompt_tokens: int
    kv_new_tokens: int
    batch_requests: int
    batch_prompt_len: tuple[int, int]
    batch_max_tokens: tuple[int, int]
    batch_max_num_seqs: int  # for both schedulers: a static batch is this many requests
    prefix_tokens: int  # the shared "system prompt"
    prefix_suffix_tokens: int
    prefix_requests: int
    prefix_new_tokens: int
    chunk_prompt_tokens: int  # the long prompt that arrives while others decode
    chunk_budget: int  # max_num_batched_tokens with chunked prefill on
    chunk_decodes: int
    chunk_decode_prompt_tokens: int
    chunk_decode_tokens: int
    chunk_warm_steps: int  # decode steps before the long prompt arrives
    memory_max_model_len: int  # the span a contiguous cache reserves per request
    memory_pool_requests: int  # pool size, in max-length requests
    spec_rewrite_tokens: int  # generated on the `rewrite` workload (the passage is ~100 tokens)
    spec_chat_tokens: int  # generated on the `chat` workload
    spec_batch_requests: int  # all of them running at once
    spec_batch_prompt_len: tuple[int, int]
    spec_batch_max_tokens: tuple[int, int]
    loop_batch_requests: int  # the decode loop's small batch, all running at once
    loop_new_tokens: int  # generated per request of that batch
    arrival_rates: tuple[float, ...]  # requests/s offered to each scheduler's server, in turn
    arrival_requests: int  # sent at each rate
    arrival_short: RequestShape
    arrival_long: RequestShape
    arrival_long_share: float  # of the requests, on average

    def with_arrivals(
        self, rates: tuple[float, ...] | None = None, requests: int | None = None
    ) -> AblateSizes:
        """These sizes with other arrival rates or requests per rate."""
        if requests is not None and requests < 1:
            raise ValueError(f"requests per rate must be >= 1, got {requests}")
        return replace(
            self,
            arrival_rates=self.arrival_rates if rates is None else rates,
            arrival_requests=self.arrival_requests if requests is None else requests,
        )


FULL = AblateSizes(
    kv_prompt_tokens=32,
    kv_new_tokens=256,
    batch_requests=64,
    batch_prompt_len=(32, 256),
    batch_max_tokens=(32, 256),
    batch_max_num_seqs=16,
    prefix_tokens=1024,
    prefix_suffix_tokens=32,
    prefix_requests=8,
    prefix_new_tokens=8,
    chunk_prompt_tokens=2000,
    chunk_budget=256,
    chunk_decodes=4,
    chunk_decode_prompt_tokens=32,
    chunk_decode_tokens=48,
    chunk_warm_steps=4,
    memory_max_model_len=512,
    memory_pool_requests=17,
    spec_rewrite_tokens=100,
    spec_chat_tokens=128,
    spec_batch_requests=32,
    spec_batch_prompt_len=(32, 256),
    spec_batch_max_tokens=(16, 32),
    loop_batch_requests=8,
    loop_new_tokens=128,
    arrival_rates=(0.5, 1.0, 2.0, 4.0),
    arrival_requests=30,
    arrival_short=RequestShape(prompt_len=(16, 64), max_tokens=(16, 64)),
    arrival_long=RequestShape(prompt_len=(256, 512), max_tokens=(64, 128)),
    arrival_long_share=0.25,
)

QUICK = AblateSizes(
    kv_prompt_tokens=8,
    kv_new_tokens=8,
    batch_requests=6,
    batch_prompt_len=(8, 24),
    batch_max_tokens=(3, 8),
    batch_max_num_seqs=3,
    prefix_tokens=64,
    prefix_suffix_tokens=8,
    prefix_requests=3,
    prefix_new_tokens=2,
    chunk_prompt_tokens=96,
    chunk_budget=32,
    chunk_decodes=2,
    chunk_decode_prompt_tokens=8,
    chunk_decode_tokens=12,
    chunk_warm_steps=2,
    memory_max_model_len=48,
    memory_pool_requests=2,
    spec_rewrite_tokens=12,
    spec_chat_tokens=8,
    spec_batch_requests=6,
    spec_batch_prompt_len=(8, 24),
    spec_batch_max_tokens=(3, 8),
    loop_batch_requests=3,
    loop_new_tokens=4,
    arrival_rates=(2.0, 8.0),
    arrival_requests=3,
    arrival_short=RequestShape(prompt_len=(8, 16), max_tokens=(2, 4)),
    arrival_long=RequestShape(prompt_len=(32, 48), max_tokens=(4, 8)),
    arrival_long_share=0.34,
)
