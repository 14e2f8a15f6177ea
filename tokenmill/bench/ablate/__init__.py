"""`tokenmill bench ablate`: each technique off and on, on the real model, in one run.

Every experiment loads nothing itself: the engines share one loaded model and differ only in
the switch under test, so a difference is the technique's. Steps are timed from outside
(`LLMEngine.step()` wall time); nothing inside the engine is instrumented. `FULL` is the run
docs/benchmarks.md reports; `QUICK` shrinks every experiment to a few tokens so the whole command
runs in seconds.

The experiments are grouped by theme: kv (KV cache, KV memory, prefix caching), scheduling
(batching, chunked prefill), speculation, kernels (decode loop, prepacked weights). sizes,
observers and context hold what they share; run holds the registry by name and the run itself.
"""

from tokenmill.bench.ablate.context import AblateContext, Experiment
from tokenmill.bench.ablate.run import EXPERIMENTS, AblateReport, run_ablate
from tokenmill.bench.ablate.sizes import FULL, QUICK, AblateSizes

__all__ = [
    "EXPERIMENTS",
    "FULL",
    "QUICK",
    "AblateContext",
    "AblateReport",
    "AblateSizes",
    "Experiment",
    "run_ablate",
]
