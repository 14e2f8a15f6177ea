"""`tokenmill serve`: the OpenAI-compatible HTTP server (tokenmill/server), over one model or
several (repeated `--model`, or `--config`), with optional routing and a semantic cache
(docs/routing-and-caching.md)."""

from __future__ import annotations

import argparse
import os

from tokenmill.cli.engine_args import add_engine_args, engine_args_from
from tokenmill.gateway.confidence import CONFIDENCE_METRICS
from tokenmill.gateway.routing import DEFAULT_THRESHOLDS, POLICIES
from tokenmill.gateway.semantic_cache import DEFAULT_THRESHOLD, CacheSettings


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
    serve.add_argument(
        "--config",
        default=None,
        help="a .toml/.json/.yaml file naming each model with its own engine flags, and routes "
        "(replaces --model; see tokenmill/gateway/serve_config.py)",
    )
    _add_route_args(serve)
    _add_cache_args(serve)
    _add_replica_args(serve)
    add_engine_args(serve, several_models=True)
    serve.set_defaults(func=run)


def _add_route_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("routing: one name in front of the first two models")
    group.add_argument(
        "--route-policy",
        choices=POLICIES,
        default=None,
        help="serve a route (default: none) that picks the first --model (small) or the second",
    )
    group.add_argument("--route-name", default="auto", help="the model name the route answers to")
    group.add_argument(
        "--route-threshold",
        type=float,
        default=None,
        help="cascade: token logprob to escalate under; random: large-model share; classifier: "
        f"probability (defaults {DEFAULT_THRESHOLDS})",
    )
    group.add_argument("--route-metric", choices=CONFIDENCE_METRICS, default="mean")
    group.add_argument(
        "--route-classifier", default=None, help="classifier: the file `router train` wrote"
    )


def _add_replica_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("scale-out: engine replicas on Ray Serve (docs/scaling.md)")
    group.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="run N engine replicas on Ray Serve behind this endpoint (default: one engine in "
        "this process, no Ray)",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        help="join a running Ray cluster ('auto' or HOST:PORT); default: start a local Ray on "
        "loopback",
    )
    group.add_argument(
        "--threads-per-replica",
        type=int,
        default=1,
        help="compute threads of each replica, pinned to cores of their own where there are enough",
    )
    group.add_argument(
        "--routing",
        choices=("prefix", "pow2"),
        default="prefix",
        help="prefix: send a prompt to the replica likely to hold its prefix, least loaded when "
        "load is imbalanced; pow2: Ray Serve's power of two choices (the baseline)",
    )


def _add_cache_args(serve: argparse.ArgumentParser) -> None:
    defaults = CacheSettings()
    group = serve.add_argument_group("semantic response cache")
    group.add_argument(
        "--semantic-cache",
        action="store_true",
        help="answer repeated and paraphrased requests from a cache (default: off)",
    )
    group.add_argument(
        "--semantic-cache-threshold",
        default=str(DEFAULT_THRESHOLD),
        help="least cosine similarity of a semantic hit, in [0, 1], or the file "
        "`tokenmill cache calibrate` wrote",
    )
    group.add_argument("--semantic-cache-ttl", type=float, default=defaults.ttl_s, help="seconds")
    group.add_argument("--semantic-cache-capacity", type=int, default=defaults.capacity)
    group.add_argument(
        "--semantic-cache-path",
        default=None,
        help="keep the cache in this SQLite file, so a restarted server hits (default: memory)",
    )
    group.add_argument(
        "--semantic-cache-guard",
        action=argparse.BooleanOptionalAction,
        default=defaults.guard,
        help="a semantic hit must name the same numbers and negations, words in the same order",
    )


def run(ns: argparse.Namespace) -> int:
    if ns.replicas is not None:
        return _run_replicas(ns)
    from tokenmill.server.app import run_server

    models, routes = _models_and_routes(ns)
    return run_server(
        models,
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key,
        served_model_name=ns.served_model_name,
        max_waiting_requests=ns.max_waiting_requests,
        shutdown_timeout_s=ns.shutdown_timeout,
        ui=ns.ui,
        routes=routes,
        semantic_cache=_semantic_cache(ns),
    )


def _run_replicas(ns: argparse.Namespace) -> int:
    from tokenmill.cluster.app import ClusterSettings
    from tokenmill.cluster.launch import run_cluster_server

    if ns.config is not None or len(ns.model or []) > 1 or ns.route_policy or ns.semantic_cache:
        raise ValueError(
            "--replicas serves one model: drop --config, a second --model, --route-policy and "
            "--semantic-cache"
        )
    settings = ClusterSettings(
        engine_args_from(ns),
        num_replicas=ns.replicas,
        threads_per_replica=ns.threads_per_replica,
        routing=ns.routing,
        served_model_name=ns.served_model_name,
        api_key=ns.api_key,
        max_waiting_requests=ns.max_waiting_requests,
        ui=ns.ui,
        shutdown_timeout_s=ns.shutdown_timeout,
    )
    return run_cluster_server(settings, ns.host, ns.port, ns.ray_address)


def _models_and_routes(ns: argparse.Namespace) -> tuple[list, dict]:
    from tokenmill.gateway.registry import specs_from_flags
    from tokenmill.gateway.routing import route_spec
    from tokenmill.gateway.serve_config import read_serve_config

    base = engine_args_from(ns)
    if ns.config is not None:
        if ns.model:
            raise ValueError("give the models either with --model or in --config, not both")
        config = read_serve_config(ns.config, base)
        models, routes = config.models, dict(config.routes)
    else:
        models, routes = specs_from_flags(ns.model or [base.model], base, ns.served_model_name), {}
    if ns.route_policy is not None:
        entry = {"policy": ns.route_policy, "metric": ns.route_metric}
        if ns.route_threshold is not None:
            entry["threshold"] = ns.route_threshold
        if ns.route_classifier is not None:
            entry["classifier"] = ns.route_classifier
        names = [m.name for m in models]
        if len(names) < 2:
            raise ValueError("--route-policy needs two models: give --model twice")
        routes[ns.route_name] = route_spec(ns.route_name, entry, names, "--route-policy")
    return models, routes


def _semantic_cache(ns: argparse.Namespace):
    if not ns.semantic_cache:
        if ns.semantic_cache_path is not None:
            raise ValueError("--semantic-cache-path needs --semantic-cache")
        return None
    from tokenmill.gateway.cache_eval import read_threshold
    from tokenmill.gateway.cache_store import CacheStore
    from tokenmill.gateway.embedding import packaged_embedder
    from tokenmill.gateway.semantic_cache import SemanticCache

    settings = CacheSettings(
        read_threshold(ns.semantic_cache_threshold),
        ns.semantic_cache_ttl,
        ns.semantic_cache_capacity,
        ns.semantic_cache_guard,
    )
    store = None if ns.semantic_cache_path is None else CacheStore(ns.semantic_cache_path)
    return SemanticCache(settings, packaged_embedder(), store=store)
