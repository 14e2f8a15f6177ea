"""`tokenmill generate`: stream a completion for one prompt to stdout."""

from __future__ import annotations

import argparse
import sys
import time

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.cli.sampling_args import add_sampling_args, sampling_params_from
from tokenmill.cli.streaming import chat_prompt, stream
from tokenmill.engine.engine import LLMEngine, PromptInput


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    generate.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
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
