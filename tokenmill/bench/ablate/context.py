"""What every ablate experiment shares: the loaded model and base engine args it varies, the
result it hands back, and one greedy run of a workload on a fresh engine."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.bench.ablate.observers import FinishedTokens
from tokenmill.bench.ablate.sizes import AblateSizes
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.throughput import ThroughputResult, run_throughput
from tokenmill.bench.workloads import BenchRequest, random_requests, random_token_ids
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.sampling.params import SamplingParams


@dataclass
class Experiment:
    """What one technique's experiment hands back: verdict rows, raw series, its chart."""

    rows: list[Comparison]
    data: dict[str, Any]
    plot: Path


@dataclass
class AblateContext:
    loaded: LoadedModel
    base: EngineArgs
    sizes: AblateSizes
    out_dir: Path

    def engine(self, **switches: Any) -> LLMEngine:
        """A fresh engine on the shared model, warmed up so one-time costs are not measured."""
        engine = LLMEngine(replace(self.base, **switches), self.loaded)
        warm_up = BenchRequest(random_token_ids(random.Random(99), 8), None, 2)
        run_throughput(engine, [warm_up], "warm-up", use_tqdm=False)
        return engine


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def greedy_run(
    ctx: AblateContext, requests: list[BenchRequest], label: str, **switches: Any
) -> tuple[ThroughputResult, dict[tuple[int, ...], list[int]]]:
    """One greedy pass on a fresh paged-KV engine: its numbers and every request's output
    tokens, keyed by prompt, so two variants' outputs can be compared. The other switches are
    the base's."""
    engine = ctx.engine(kv_cache="paged", **switches)
    finished = FinishedTokens()
    result = run_throughput(engine, requests, label, on_step=finished)
    return result, finished.by_prompt


def yes_no(flag: bool) -> str:
    return "yes" if flag else "NO"


def batch_requests(sizes: AblateSizes) -> list[BenchRequest]:
    return random_requests(1, sizes.batch_requests, sizes.batch_prompt_len, sizes.batch_max_tokens)
