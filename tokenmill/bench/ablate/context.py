"""What every ablate experiment shares: the model (loaded on first use) and base engine args it
varies, the result it hands back, and one greedy run of a workload on a fresh engine."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenmill.bench.ablate.observers import FinishedTokens
from tokenmill.bench.ablate.sizes import AblateSizes
from tokenmill.bench.comparison import Comparison
from tokenmill.bench.throughput import ThroughputResult, run_throughput
from tokenmill.bench.workloads import BenchRequest, random_requests, random_token_ids
from tokenmill.config import SCHEDULERS, EngineArgs, parse_dtype
from tokenmill.engine.engine import LLMEngine
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.sampling.params import SamplingParams


@dataclass
class Experiment:
    """What one technique's experiment hands back: verdict rows, raw series, its chart, and a
    table of its own for results that are more than one metric off and on."""

    rows: list[Comparison]
    data: dict[str, Any]
    plot: Path
    table: str | None = None


@dataclass(frozen=True)
class ArrivalsOptions:
    """The arrivals experiment's settings that are not sizes: the schedulers it compares, the
    objectives a request must meet to count toward goodput, and the seed of its arrivals and
    prompts."""

    schedulers: tuple[str, ...] = ("static", "dynamic", "continuous")
    ttft_slo_ms: float = 2000.0
    tpot_slo_ms: float = 100.0
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [s for s in self.schedulers if s not in SCHEDULERS]
        if not self.schedulers or unknown or len(set(self.schedulers)) < len(self.schedulers):
            raise ValueError(
                f"schedulers must be distinct names from {', '.join(SCHEDULERS)}, "
                f"got {','.join(self.schedulers)!r}"
            )
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a number of milliseconds > 0")

    @property
    def slos(self) -> dict[str, float]:
        """As `bench serve`'s goodput takes them."""
        return {"ttft_ms": self.ttft_slo_ms, "tpot_ms": self.tpot_slo_ms}


@dataclass
class AblateContext:
    base: EngineArgs
    sizes: AblateSizes
    out_dir: Path
    arrivals: ArrivalsOptions = field(default_factory=ArrivalsOptions)

    @cached_property
    def loaded(self) -> LoadedModel:
        """The base model, loaded once for every in-process engine; an experiment that runs
        servers of their own never loads it here."""
        return load_model(self.base.model, parse_dtype(self.base.dtype))

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
