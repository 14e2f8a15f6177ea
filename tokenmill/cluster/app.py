"""The Ray Serve application: an ingress deployment that runs the server's own FastAPI app
(routes, streaming, errors, API key, back-pressure: tokenmill.server) over RemoteEngine, in
front of N EngineReplica deployments reached through one DeploymentHandle whose request router
is the prefix-aware one (or Serve's power-of-two-choices, the baseline).

`build_cluster_app` is what `tokenmill serve --replicas` runs; `app_builder` lets Serve's own
CLI run it on a cluster (`serve run tokenmill.cluster.app:app_builder model=... replicas=4`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, fields
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from tokenmill.cluster.board import get_board
from tokenmill.cluster.prefix_router import ROUTER_PATH
from tokenmill.cluster.remote_engine import ModelView, RemoteEngine
from tokenmill.cluster.replica import EngineReplica
from tokenmill.config import EngineArgs
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.resolve import resolve_model
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.server.app import build_app_over

ROUTINGS = ("prefix", "pow2")
APP_NAME = "tokenmill"
HEALTH_CHECK_PERIOD_S = 2.0
INGRESS_MAX_ONGOING = 4096


@dataclass(frozen=True)
class ClusterSettings:
    args: EngineArgs
    num_replicas: int = 2
    threads_per_replica: int = 1
    routing: str = "prefix"
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting_requests: int | None = 256
    ui: bool = True
    shutdown_timeout_s: float = 30.0
    router_kwargs: dict[str, Any] = field(default_factory=dict)  # PrefixPolicy's fields

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.num_replicas}")
        if self.threads_per_replica < 1:
            raise ValueError(
                f"threads_per_replica must be at least 1, got {self.threads_per_replica}"
            )
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.args.model


def load_tokenizer(model: str) -> Tokenizer:
    """The model's tokenizer alone, as load_model builds it, without reading any weight."""
    path = resolve_model(model)
    if path.is_dir():
        return Tokenizer.from_pretrained_dir(path)
    return Tokenizer.from_gguf_metadata(GGUFFile(path).metadata)


@serve.ingress()
class Ingress:
    async def __init__(self, engines: DeploymentHandle, settings: ClusterSettings) -> None:
        self.engines = engines
        self.settings = settings

    async def __serve_build_asgi_app__(self) -> Any:
        settings = self.settings
        facts = await self.engines.facts.remote()
        tokenizer = await asyncio.to_thread(load_tokenizer, facts.model)
        board = get_board(serve.get_replica_context().app_name)
        await board.forget_ranks_from.remote(settings.num_replicas)
        remote = RemoteEngine(
            self.engines, ModelView.of(facts, tokenizer), board, settings.num_replicas
        )
        return build_app_over({settings.model_name: remote}, settings.api_key, settings.ui)


def build_cluster_app(settings: ClusterSettings) -> serve.Application:
    max_waiting = settings.max_waiting_requests
    router = RequestRouterConfig(
        request_router_class=ROUTER_PATH, request_router_kwargs=settings.router_kwargs
    )
    replica = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        num_replicas=settings.num_replicas,
        ray_actor_options={"num_cpus": settings.threads_per_replica},
        # Requests beyond the engine's own queue wait in Serve's, up to as many again; past
        # that Serve refuses them (a 503, like a full engine queue).
        max_ongoing_requests=settings.args.max_num_seqs + (max_waiting or 1024),
        max_queued_requests=max_waiting if max_waiting is not None else -1,
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        **({"request_router_config": router} if settings.routing == "prefix" else {}),
    )
    ingress = serve.deployment(
        Ingress,
        name="Ingress",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=INGRESS_MAX_ONGOING,
        graceful_shutdown_timeout_s=settings.shutdown_timeout_s,
    )
    engines = replica.bind(settings.args, settings.threads_per_replica, max_waiting)
    return ingress.bind(engines, settings)


def app_builder(config: dict[str, str]) -> serve.Application:
    """For `serve run` / `serve deploy`: `model=...` plus ClusterSettings' and EngineArgs'
    scalar fields by name (`replicas=4 threads_per_replica=8 kv_cache_memory=8GiB`)."""
    config = dict(config)
    replicas = int(config.pop("replicas", "1"))
    setting_types = {f.name: f.type for f in fields(ClusterSettings)}
    arg_types = {f.name: f.type for f in fields(EngineArgs)}
    settings_given: dict[str, Any] = {}
    args_given: dict[str, Any] = {}
    for key, text in config.items():
        if key in setting_types and key not in ("args", "router_kwargs"):
            settings_given[key] = _parse(text, str(setting_types[key]))
        elif key in arg_types:
            args_given[key] = _parse(text, str(arg_types[key]))
        else:
            raise ValueError(f"unknown setting {key!r} for the tokenmill Serve app")
    settings = ClusterSettings(EngineArgs(**args_given), replicas, **settings_given)
    return build_cluster_app(settings)


def _parse(text: str, annotation: str) -> Any:
    if "bool" in annotation:
        return text.lower() in ("1", "true", "yes", "on")
    if annotation.startswith("int") and text.lstrip("-").isdigit():
        return int(text)
    if annotation.startswith("float"):
        return float(text)
    return text
