"""`tokenmill` command line: generate, chat, bench."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

from tokenmill.config import DTYPES, KV_CACHE_MODES, SCHEDULERS, EngineArgs
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.errors import ModelLoadError
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
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--scheduler", default="continuous", choices=SCHEDULERS)
    group.add_argument("--max-num-seqs", type=int, default=64)
    group.add_argument("--max-num-batched-tokens", type=int, default=2048)
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--max-model-len", type=int, default=None)


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


def cmd_bench_throughput(ns: argparse.Namespace) -> int:
    from tokenmill.bench.throughput import run_throughput, write_json
    from tokenmill.bench.workloads import load_workload

    requests = load_workload(ns.workload)
    args = engine_args_from(ns)
    engine = LLMEngine(args)
    result = run_throughput(engine, requests, ns.workload)
    print(result.table())
    if ns.json:
        write_json(result, Path(ns.json), dataclasses.asdict(args))
    return 0


def cmd_export_hf(ns: argparse.Namespace) -> int:
    from tokenmill.loader.export import export_hf

    out = export_hf(ns.model, Path(ns.out_dir))
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

    bench = commands.add_parser("bench", help="measure tokenmill on a workload")
    bench_kinds = bench.add_subparsers(dest="bench", required=True)
    throughput = bench_kinds.add_parser("throughput", help="offline throughput and latency")
    throughput.add_argument(
        "--workload", default="batch64", help="batch64, single, or a JSONL file of requests"
    )
    throughput.add_argument("--json", default=None, help="also write the result as JSON here")
    add_engine_args(throughput)
    throughput.set_defaults(func=cmd_bench_throughput)

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
