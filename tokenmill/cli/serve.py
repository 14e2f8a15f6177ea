"""`tokenmill serve`: the OpenAI-compatible HTTP server (tokenmill/server)."""

from __future__ import annotations

import argparse
import os

from tokenmill.cli.engine_args import add_engine_args, engine_args_from


def add_parser(commands: argparse._SubParsersAction) -> None:
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
    serve.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the web playground and live dashboard at /",
    )
    add_engine_args(serve)
    serve.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from tokenmill.server.app import run_server

    return run_server(
        engine_args_from(ns),
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        served_model_name=ns.served_model_name,
        max_waiting_requests=ns.max_waiting_requests,
        shutdown_timeout_s=ns.shutdown_timeout,
        ui=ns.ui,
    )
