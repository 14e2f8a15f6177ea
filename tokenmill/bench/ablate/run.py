"""The ablate experiments by name (the `--only` names) and the run that writes their table,
plots and JSON."""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenmill.bench.ablate.arrivals import arrivals
from tokenmill.bench.ablate.context import AblateContext, ArrivalsOptions, Experiment
from tokenmill.bench.ablate.kernels import decode_loop, prepacked_weights
from tokenmill.bench.ablate.kv import kv_cache, kv_memory, prefix_caching
from tokenmill.bench.ablate.scheduling import batching, chunked_prefill
from tokenmill.bench.ablate.sizes import AblateSizes
from tokenmill.bench.ablate.speculation import speculative, speculative_batch
from tokenmill.bench.comparison import Comparison, comparison_table
from tokenmill.bench.report import write_json
from tokenmill.config import EngineArgs

EXPERIMENTS: dict[str, Callable[[AblateContext], Experiment]] = {
    "kv-cache": kv_cache,
    "batching": batching,
    "prefix-caching": prefix_caching,
    "chunked-prefill": chunked_prefill,
    "kv-memory": kv_memory,
    "speculative": speculative,
    "speculative-batch": speculative_batch,
    "decode-loop": decode_loop,
    "prepacked-weights": prepacked_weights,
    "arrivals": arrivals,
}
ON_REQUEST = ("arrivals",)
"""Run only when `--only` names them: they start servers of their own and take minutes more
than the rest together."""
DEFAULT_EXPERIMENTS = tuple(name for name in EXPERIMENTS if name not in ON_REQUEST)


@dataclass
class AblateReport:
    rows: list[Comparison]
    experiments: dict[str, Experiment]

    def table(self) -> str:
        """The verdict rows, then each experiment's own table under its name."""
        tables = [comparison_table(self.rows)]
        for name, experiment in self.experiments.items():
            if experiment.table is not None:
                tables.append(f"{name}:\n\n{experiment.table}")
        return "\n\n".join(tables)


def run_ablate(
    base: EngineArgs,
    sizes: AblateSizes,
    out_dir: Path,
    only: list[str] | None = None,
    arrivals: ArrivalsOptions | None = None,
) -> AblateReport:
    """Runs the chosen experiments (`DEFAULT_EXPERIMENTS` if none) and writes the PNGs,
    ablate.md and ablate.json into `out_dir`."""
    names = only or list(DEFAULT_EXPERIMENTS)
    unknown = [n for n in names if n not in EXPERIMENTS]
    if unknown:
        raise ValueError(f"only must name experiments from {', '.join(EXPERIMENTS)}: {unknown}")
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = AblateContext(base, sizes, out_dir, arrivals or ArrivalsOptions())
    experiments = {}
    for name in names:
        print(f"ablate: {name}", file=sys.stderr)
        experiments[name] = EXPERIMENTS[name](ctx)
        gc.collect()  # the previous engines' KV pools
    report = AblateReport([row for e in experiments.values() for row in e.rows], experiments)
    (out_dir / "ablate.md").write_text(report.table() + "\n", encoding="utf-8")
    write_json(
        out_dir / "ablate.json",
        {
            "benchmark": "ablate",
            "engine_args": dataclasses.asdict(base),
            "sizes": dataclasses.asdict(sizes),
            "rows": report.rows,
            "experiments": {
                name: {"data": e.data, "plot": e.plot.name} for name, e in experiments.items()
            },
        },
    )
    return report
