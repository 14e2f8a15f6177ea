"""`tokenmill chat`: an interactive chat on stdin that keeps the conversation's history."""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.cli.sampling_args import add_sampling_args, sampling_params_from
from tokenmill.cli.streaming import chat_prompt, stream
from tokenmill.engine.engine import LLMEngine


def add_parser(commands: argparse._SubParsersAction) -> None:
    chat = commands.add_parser("chat", help="interactive chat with history")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
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
