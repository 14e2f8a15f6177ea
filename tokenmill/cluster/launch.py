"""Starting and stopping Ray for a tokenmill command: a local Ray on loopback (no dashboard) when
no address is given, so one machine needs nothing else; an existing cluster otherwise."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import ray
from ray import serve

from tokenmill.cluster.app import APP_NAME, ClusterSettings, build_cluster_app
from tokenmill.cluster.board import NAMESPACE, board_name

LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
"""Only outputs and metric reports travel through it: a small store leaves memory to engines."""


@contextmanager
def ray_session(address: str | None, num_cpus: int) -> Iterator[None]:
    """`address`: None starts a local Ray with `num_cpus` logical CPUs; "auto" or HOST:PORT
    joins a running one."""
    if address is None:
        ray.init(
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            num_cpus=num_cpus,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            log_to_driver=False,
        )
    else:
        ray.init(address=address, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def local_cpus(settings: ClusterSettings) -> int:
    """Enough logical CPUs for every replica to be placed (pinning is skipped where cores are
    short), and the machine's count where it has more."""
    return max(os.cpu_count() or 1, settings.num_replicas * settings.threads_per_replica)


def deploy(settings: ClusterSettings, host: str, port: int) -> str:
    """Run the app on the connected Ray; returns its URL once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_cluster_app(settings), name=APP_NAME, route_prefix="/", blocking=False)
    return f"http://{host}:{port}"


def undeploy() -> None:
    """Drain: Serve stops routing, waits for in-flight requests (up to the deployments'
    graceful_shutdown_timeout_s) and stops the replicas, while the proxy still carries their
    responses; then stops the proxy."""
    with contextlib.suppress(Exception):  # the app may be gone already
        serve.delete(APP_NAME)
    serve.shutdown()
    with contextlib.suppress(ValueError):  # no board: the app never served
        ray.kill(ray.get_actor(board_name(APP_NAME), namespace=NAMESPACE))


def run_cluster_server(
    settings: ClusterSettings, host: str, port: int, ray_address: str | None
) -> int:
    """`tokenmill serve --replicas N`: serve until SIGTERM or SIGINT, then drain."""
    stop = threading.Event()
    with ray_session(ray_address, local_cpus(settings)):
        for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
            signal.signal(signum, lambda *_: stop.set())
        url = deploy(settings, host, port)
        print(
            f"tokenmill: serving {settings.model_name} on {url} with {settings.num_replicas} "
            f"replicas x {settings.threads_per_replica} threads, routing={settings.routing}",
            flush=True,
        )
        stop.wait()
        print("tokenmill: draining the replicas", flush=True)
        undeploy()
    return 0
