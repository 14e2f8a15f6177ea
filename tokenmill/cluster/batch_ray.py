"""`tokenmill batch --replicas N` on Ray Data: the remaining input lines as a dataset,
`map_batches` over a pool of N engine actors (one LLM each, T threads), rows kept in the input's
order and appended to the output as they arrive (Ray Data draws the progress bars)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray

from tokenmill.cluster.batch_job import CHUNK_LINES, BatchLine, complete
from tokenmill.config import EngineArgs
from tokenmill.llm import LLM
from tokenmill.sampling.params import SamplingParams


class EngineBatcher:
    """One engine actor of the pool: input rows (index, record JSON) to output lines."""

    def __init__(self, args: EngineArgs, threads: int, default: SamplingParams) -> None:
        import torch

        torch.set_num_threads(threads)
        self.llm = LLM(**vars(args))
        self.default = default

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        lines = [
            BatchLine(int(i), json.loads(r))
            for i, r in zip(batch["index"], batch["record"], strict=True)
        ]
        return {"line": np.array(complete(self.llm, lines, self.default), dtype=object)}


def run_on_ray(
    args: EngineArgs,
    lines: Sequence[BatchLine],
    output: Path,
    default: SamplingParams,
    replicas: int,
    threads: int,
) -> None:
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    rows = [{"index": line.index, "record": json.dumps(line.record)} for line in lines]
    num_blocks = max(replicas, -(-len(rows) // CHUNK_LINES))
    dataset = ray.data.from_items(rows, override_num_blocks=num_blocks)
    results = dataset.map_batches(
        EngineBatcher,
        fn_constructor_args=(args, threads, default),
        batch_size=CHUNK_LINES,
        compute=ray.data.ActorPoolStrategy(size=replicas),
        num_cpus=threads,
    )
    with output.open("a", encoding="utf-8") as out:
        for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
            out.writelines(batch["line"])
            out.flush()
