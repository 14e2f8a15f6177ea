"""Where a workload's time goes: the workload runs once as `bench throughput` runs it, then again
on a fresh engine over the same loaded model with every kernel call timed (kernels/op_timer.py)
and summed by op class (op_classes.py). The step time no kernel accounts for is host time:
Python, torch's small ops and the dispatch between kernels; the recorder's own bookkeeping (what
each call's work was) is timed and reported apart from it.

Steps the native decode loop runs report each kind of kernel's time from inside the loop;
steps that run layer by layer in Python report each op call. Both are counted, and the report
says how many steps and how much time each path took.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenmill.bench.roofline.op_classes import (
    ATTENTION_DECODE,
    HOST,
    KV_STORE,
    NORMS,
    OTHER,
    PROFILER,
    Work,
    attended_lengths,
    describe,
    dtype_name,
    product,
)
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.workloads import BenchRequest
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.engine.outputs import RequestOutput
from tokenmill.kernels import op_timer
from tokenmill.loader.model_loader import LoadedModel

NATIVE_PATH = "native decode loop"
PYTHON_PATH = "python layers"
LOOP_PRODUCTS = ("qkv", "o", "gate_up", "down")


@dataclass
class ClassTime:
    """The time and work of the calls summed under one (class, label, roof dtype)."""

    op_class: str
    label: str
    roof_dtype: str = ""
    seconds: float = 0.0
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass
class Profile:
    workload: str
    engine: dict[str, Any]  # the engine flags that shape the profile
    output_tokens: int
    unprofiled_s: float | None  # the workload without timing (None: not run)
    profiled_s: float  # with every kernel timed; the classes add up to this
    steps: dict[str, int] = field(default_factory=dict)  # per path
    step_seconds: dict[str, float] = field(default_factory=dict)
    classes: list[ClassTime] = field(default_factory=list)  # the host row last

    @property
    def read_bytes_per_step(self) -> int:
        """What a step reads on average (weights, KV and activations, as the classes count)."""
        steps = sum(self.steps.values())
        return int(sum(c.bytes for c in self.classes) / steps) if steps else 0

    @property
    def overhead(self) -> float | None:
        """How much longer the profiled run took than the plain one (a fraction)."""
        if not self.unprofiled_s:
            return None
        return self.profiled_s / self.unprofiled_s - 1

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        classes = [ClassTime(**c) for c in data.get("classes", [])]
        return cls(**{**data, "classes": classes})


@dataclass(frozen=True)
class _LoopLayer:
    """What one decoder layer of the native loop does per token, for its kernels' work."""

    products: tuple[tuple[str, str, int, int, int], ...]  # (op, kernel kind, K, N, weight bytes)
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    window: int | None
    activation: str  # the config's name: silu, gelu_pytorch_tanh


def _loop_layers(model: torch.nn.Module) -> list[_LoopLayer]:
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        products = tuple(
            (
                op,
                _kernel_kind(linear),
                linear.in_features,
                linear.out_features,
                _weight_bytes(linear),
            )
            for op, linear in zip(LOOP_PRODUCTS, linears, strict=True)
        )
        layers.append(
            _LoopLayer(
                products,
                attn.num_heads,
                attn.num_kv_heads,
                attn.head_dim,
                attn.qkv_proj.in_features,
                mlp.down_proj.in_features,
                attn.window,
                mlp.activation,
            )
        )
    return layers


def _kernel_kind(linear: torch.nn.Module) -> str:
    kernel = linear.native_kernel()
    return "float32" if kernel is None else kernel.kind


def _weight_bytes(linear: torch.nn.Module) -> int:
    return sum(p.nbytes for name, p in linear.named_parameters() if name != "bias")


class ClassRecorder:
    """Sums kernel calls by class: the recorder `op_timer` reports to during a profile."""

    def __init__(self, model: torch.nn.Module, loop_owner: object | None) -> None:
        self.vocab_size = model.config.vocab_size
        self.loop_owner = loop_owner  # the runner's NativeLayers; a drafter's own count apart
        self.loop_layers = _loop_layers(model) if loop_owner is not None else []
        self.times: dict[tuple[str, str, str], ClassTime] = {}
        self.used_loop = False  # whether the current step ran the native loop
        # The recorder's own time (describing each call's work): between kernels, yet no part
        # of the engine's host time.
        self.bookkeeping_s = 0.0

    def add(self, work: Work, seconds: float, calls: int = 1) -> None:
        key = (work.op_class, work.label, work.roof_dtype)
        entry = self.times.get(key)
        if entry is None:
            entry = self.times[key] = ClassTime(*key)
        entry.seconds += seconds
        entry.calls += calls
        entry.flops += work.flops
        entry.bytes += work.bytes

    def op(self, name: str, args: tuple[Any, ...], result: Any, seconds: float) -> None:
        start = time.perf_counter()
        self.add(describe(name, args, result, self.vocab_size), seconds)
        self.bookkeeping_s += time.perf_counter() - start

    def decode_loop(
        self, owner: object, args: tuple[Any, ...], op_seconds: dict[str, float], seconds: float
    ) -> None:
        start = time.perf_counter()
        self.used_loop = True
        if owner is not self.loop_owner:
            self.add(Work(OTHER, "drafter decode loop", "", 0.0, 0.0), sum(op_seconds.values()))
        else:
            for work, share, calls in self._loop_work(args, op_seconds):
                self.add(work, share, calls)
        self.bookkeeping_s += time.perf_counter() - start

    def _loop_work(
        self, args: tuple[Any, ...], op_seconds: dict[str, float]
    ) -> Iterator[tuple[Work, float, int]]:
        """Each kind of the loop's kernels as (work, time, layers). A product whose layers mix
        formats (a GGUF file's) splits its time among them by weight bytes."""
        hidden, kv_caches, kv_scales, seq_lens = args[0], args[2], args[3], args[6]
        tokens, element = hidden.shape[0], hidden.element_size()
        layers = self.loop_layers
        for op in LOOP_PRODUCTS:
            works: dict[str, tuple[Work, int]] = {}
            for layer in layers:
                _, kind, k, n, nbytes = next(p for p in layer.products if p[0] == op)
                work = product(kind, tokens, k, n, nbytes, self.vocab_size)
                seen, count = works.get(work.label, (None, 0))
                works[work.label] = (work if seen is None else _merged(seen, work), count + 1)
            total = sum(w.bytes for w, _ in works.values()) or 1.0
            for work, count in works.values():
                yield work, op_seconds[op] * work.bytes / total, count
        first = layers[0]
        kv_element = kv_caches[0].element_size()
        scale_bytes = 4 if kv_scales else 0
        lengths = sum(attended_lengths(seq_lens, layer.window) for layer in layers)
        kv_bytes = lengths * 2 * first.kv_heads * (first.head_dim * kv_element + scale_bytes)
        flops = 4.0 * first.heads * first.head_dim * lengths
        kv_label = f"{dtype_name(kv_caches[0].dtype)} kv"
        attention = Work(ATTENTION_DECODE, kv_label, dtype_name(hidden.dtype), flops, kv_bytes)
        num = len(layers)
        yield attention, op_seconds["attention"], num
        kv_row = first.kv_heads * first.head_dim * element
        store = Work(KV_STORE, dtype_name(hidden.dtype), "", 0.0, num * 4.0 * tokens * kv_row)
        yield store, op_seconds["store_kv"], num
        row = tokens * first.hidden * element
        yield Work(NORMS, "rms norm", "", 0.0, num * 2 * 4.0 * row), op_seconds["norm"], num
        qk = tokens * (first.heads + first.kv_heads) * first.head_dim * element
        yield Work(NORMS, "rotary", "", 0.0, num * 2.0 * qk), op_seconds["rotary"], num
        gated = tokens * 2 * first.intermediate * element
        activation = "silu and mul" if first.activation == "silu" else "gelu and mul"
        yield Work(NORMS, activation, "", 0.0, num * 1.5 * gated), op_seconds["activation"], num

    def classes(self) -> list[ClassTime]:
        return list(self.times.values())


def _merged(a: Work, b: Work) -> Work:
    return Work(a.op_class, a.label, a.roof_dtype, a.flops + b.flops, a.bytes + b.bytes)


class _TimedCall:
    """A runner's sampler, timed as one op (the kernels it calls count as its time)."""

    def __init__(self, call: Any) -> None:
        self.call = call

    def __call__(self, *args: Any) -> Any:
        return op_timer.timed_op("sampling", self.call, args, {})


def engine_summary(args: EngineArgs) -> dict[str, Any]:
    return {
        "model": args.model,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "decode_loop": args.decode_loop,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "threads": torch.get_num_threads(),
    }


def profile_workload(
    args: EngineArgs,
    requests: list[BenchRequest],
    workload: str,
    unprofiled: bool = True,
    use_tqdm: bool = True,
    loaded: LoadedModel | None = None,
) -> Profile:
    """Runs `requests` plain (unless `unprofiled` is False), then with every kernel timed, each
    on a fresh engine (so the second finds no prefix cache the first filled); both share one
    loaded model (`loaded`, or the first engine's)."""
    unprofiled_s = None
    if unprofiled:
        engine = LLMEngine(args, loaded=loaded)
        loaded = engine.loaded
        unprofiled_s = run_throughput(engine, requests, workload, use_tqdm=use_tqdm).elapsed_s
        engine.close()
        del engine
        gc.collect()
    engine = LLMEngine(args, loaded=loaded)
    try:
        return _profiled_run(engine, args, requests, workload, unprofiled_s, use_tqdm)
    finally:
        engine.close()


def _profiled_run(
    engine: LLMEngine,
    args: EngineArgs,
    requests: list[BenchRequest],
    workload: str,
    unprofiled_s: float | None,
    use_tqdm: bool,
) -> Profile:
    runner = engine.runner
    loop_owner = runner.decode_loop.layers if runner.decode_loop is not None else None
    recorder = ClassRecorder(runner.model, loop_owner)
    steps = {NATIVE_PATH: 0, PYTHON_PATH: 0}
    step_seconds = {NATIVE_PATH: 0.0, PYTHON_PATH: 0.0}
    last = [time.monotonic()]

    def on_step(_: LLMEngine, __: list[RequestOutput]) -> None:
        now = time.monotonic()
        path = NATIVE_PATH if recorder.used_loop else PYTHON_PATH
        steps[path] += 1
        step_seconds[path] += now - last[0]
        last[0] = now
        recorder.used_loop = False

    samplers = runner.sampler, runner.rejection_sampler
    runner.sampler, runner.rejection_sampler = (_TimedCall(s) for s in samplers)
    op_timer.install(recorder)
    try:
        last[0] = time.monotonic()
        result = run_throughput(engine, requests, workload, use_tqdm=use_tqdm, on_step=on_step)
    finally:
        op_timer.install(None)
        runner.sampler, runner.rejection_sampler = samplers
    classes = sorted(recorder.classes(), key=lambda c: -c.seconds)
    kernels_s = sum(c.seconds for c in classes)
    classes.append(ClassTime(PROFILER, "", seconds=recorder.bookkeeping_s))
    host_s = result.elapsed_s - kernels_s - recorder.bookkeeping_s
    classes.append(ClassTime(HOST, "", seconds=max(host_s, 0.0)))
    return Profile(
        workload=workload,
        engine=engine_summary(args),
        output_tokens=result.output_tokens,
        unprofiled_s=unprofiled_s,
        profiled_s=result.elapsed_s,
        steps=steps,
        step_seconds=step_seconds,
        classes=classes,
    )
