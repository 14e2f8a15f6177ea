"""`tokenmill bench ablate`: each technique off and on, on the real model, in one run.

Every experiment loads nothing itself: the engines share one loaded model and differ only in
the switch under test, so a difference is the technique's. Steps are timed from outside
(`LLMEngine.step()` wall time); nothing inside the engine is instrumented. `FULL` is the run
docs/benchmarks.md reports; `QUICK` shrinks every experiment to a few tokens so the whole command
runs in seconds.

The experiments are grouped by theme: kv (KV cache, KV memory, prefix caching), scheduling
(batching, chunked prefill), speculation, kernels (decode loop, prepacked weights), and
arrivals (batching under Poisson arrivals: the one experiment that drives `tokenmill serve`
processes over HTTP instead of in-process engines, run only on request). sizes, observers and
context hold what they share; run holds the registry by name and the run itself.
"""

from tokenmill.bench.ablate.context import AblateContext, ArrivalsOptions, Experiment
from tokenmill.bench.ablate.run import (
    DEFAULT_EXPERIMENTS,
    EXPERIMENTS,
    AblateReport,
    run_ablate,
)
from tokenmill.bench.ablate.sizes import FULL, QUICK, AblateSizes

__all__ = [
    "DEFAULT_EXPERIMENTS",
    "EXPERIMENTS",
    "FULL",
    "QUICK",
    "AblateContext",
    "AblateReport",
    "AblateSizes",
    "ArrivalsOptions",
    "Experiment",
    "run_ablate",
]
