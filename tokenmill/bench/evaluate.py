"""`tokenmill eval`: what each quantization costs in quality and buys in bytes and speed.

Quality (quality.py) is measured on the held-out split of the built-in text
(tokenmill/quant/calibration.py), which no calibrating method has seen: the quantized model's
perplexity, and, position by position against the unquantized model, KL(P_ref || P_quant) of
the next-token distributions and how often both put the same token first. Speed is the
throughput benchmark's own measurement (tokenmill/bench/throughput.py) on its `single` and
`batch64` workloads.

A quantized KV cache (`kv_cache_dtype` int8 / fp8) gets rows of its own, on the unquantized
weights: there every attention score reads the stored 8-bit keys and values.
"""

from __future__ import annotations

import gc
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenmill.bench.quality import Quality, measure_quality
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workloads import load_workload
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.loader.model_loader import LoadedModel, load_model
from tokenmill.loader.resolve import resolve_model
from tokenmill.quant.calibration import split_text, text_fingerprint, token_windows
from tokenmill.quant.registry import quantization_choices

DEFAULT_EVAL_SAMPLES = 32
DEFAULT_EVAL_SEQ_LEN = 256
SPEED_WORKLOADS = ("single", "batch64")


@dataclass
class EvalRow:
    name: str  # the quantization method, a checkpoint's path, or "kv-cache int8" / "fp8"
    load_s: float  # loading, calibration included
    quality: Quality
    weight_bytes: int
    kv_bytes_per_token: int
    tokens_per_s: dict[str, float] = field(
        default_factory=dict
    )  # workload -> output tokens per second


@dataclass
class EvalReport:
    model: str
    heldout_fingerprint: str
    eval_windows: int
    eval_seq_len: int
    rows: list[EvalRow]
    python: str = field(default_factory=platform.python_version)
    torch_threads: int = field(default_factory=torch.get_num_threads)

    def table(self) -> str:
        """One line per method, columns a person compares at a glance."""
        base = self.rows[0].quality.perplexity if self.rows else float("nan")
        workloads = list(dict.fromkeys(w for row in self.rows for w in row.tokens_per_s))
        header = (
            f"{'method':<14} {'load s':>7} {'ppl':>8} {'Δppl':>7} {'KL':>8} {'top-1':>6} "
            f"{'weights MiB':>11} {'KV B/tok':>8}"
            + "".join(f" {w + ' tok/s':>14}" for w in workloads)
        )
        lines = [
            f"{self.model}: {self.eval_windows} held-out windows of {self.eval_seq_len} tokens "
            f"(text {self.heldout_fingerprint}), Python {self.python}, "
            f"{self.torch_threads} torch threads",
            header,
            "-" * len(header),
        ]
        for row in self.rows:
            q = row.quality
            speeds = "".join(f" {row.tokens_per_s.get(w, float('nan')):>14.1f}" for w in workloads)
            lines.append(
                f"{row.name:<14} {row.load_s:>7.1f} {q.perplexity:>8.3f} "
                f"{q.perplexity / base - 1:>+7.1%} {q.kl_divergence:>8.4f} "
                f"{q.top1_agreement:>6.1%} {row.weight_bytes / 2**20:>11.1f} "
                f"{row.kv_bytes_per_token:>8}" + speeds
            )
        return "\n".join(lines)

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2), encoding="utf-8")


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer, a tensor shared by two modules counted once."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers())}
    return sum(t.nbytes for t in tensors.values())


def default_methods(model: str) -> list[str]:
    """Every method that applies to `model`: `gguf` keeps a GGUF file's own blocks, so it
    needs one."""
    is_gguf = resolve_model(model).is_file()
    return [m for m in quantization_choices() if m != "gguf" or is_gguf]


def evaluate(
    model: str,
    methods: list[str],
    checkpoints: list[str],
    eval_samples: int = DEFAULT_EVAL_SAMPLES,
    eval_seq_len: int = DEFAULT_EVAL_SEQ_LEN,
    speed_workloads: tuple[str, ...] = SPEED_WORKLOADS,
    engine_options: dict[str, Any] | None = None,
    on_row: Callable[[EvalRow], None] | None = None,
    kv_cache_dtypes: tuple[str, ...] = (),
) -> EvalReport:
    """A row for `model` unquantized (the baseline), then one per quantization method of it,
    one per saved checkpoint and one per quantized KV cache dtype (on the unquantized
    weights), every one measured against the baseline."""
    options = engine_options or {}
    rows: list[EvalRow] = []

    def record(row: EvalRow) -> None:
        rows.append(row)
        if on_row is not None:
            on_row(row)

    start = time.monotonic()
    reference = load_model(model)
    windows = token_windows(reference.tokenizer, "heldout", eval_samples, eval_seq_len)
    baseline = EngineArgs(model=model, **options)
    load_s = time.monotonic() - start
    record(_measure("none", reference, load_s, baseline, reference, windows, speed_workloads))
    candidates = [(m, model, m) for m in methods if m != "none"]
    # A saved directory loads as it was quantized; a .gguf file (`tokenmill quantize --method
    # gguf-q4_k_m`, say) runs on its own blocks.
    candidates += [
        (path, path, "gguf" if path.endswith(".gguf") else "none") for path in checkpoints
    ]
    for name, path, quantization in candidates:
        start = time.monotonic()
        loaded = load_model(path, torch.float32, quantization)
        load_s = time.monotonic() - start
        args = EngineArgs(model=path, quantization=quantization, **options)
        record(_measure(name, loaded, load_s, args, reference, windows, speed_workloads))
        del loaded
        gc.collect()
    for kv_cache_dtype in kv_cache_dtypes:
        args = EngineArgs(model=model, **{**options, "kv_cache_dtype": kv_cache_dtype})
        name = f"kv-cache {kv_cache_dtype}"
        record(_measure(name, reference, 0.0, args, reference, windows, speed_workloads))
    return EvalReport(
        model=model,
        heldout_fingerprint=text_fingerprint(split_text("heldout")),
        eval_windows=eval_samples,
        eval_seq_len=eval_seq_len,
        rows=rows,
    )


def _measure(
    name: str,
    loaded: LoadedModel,
    load_s: float,
    args: EngineArgs,
    reference: LoadedModel,
    windows: torch.Tensor,
    speed_workloads: tuple[str, ...],
) -> EvalRow:
    row = EvalRow(
        name=name,
        load_s=load_s,
        quality=measure_quality(reference.model, loaded.model, windows, args.kv_cache_dtype),
        weight_bytes=model_weight_bytes(loaded.model),
        kv_bytes_per_token=LLMEngine(args, loaded=loaded).kv_bytes_per_token,
    )
    for workload in speed_workloads:  # a fresh engine each: nothing cached from the last run
        engine = LLMEngine(args, loaded=loaded)
        result = run_throughput(engine, load_workload(workload), workload, use_tqdm=False)
        row.tokens_per_s[workload] = result.output_tokens_per_s
    return row
