"""A replicated server for the cluster tests: a local Ray on loopback, 2 engine replicas x 1
thread of the packaged SmolLM2 behind one ingress, started once per module that asks for it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.config import EngineArgs

MODEL_NAME = "smollm2-135m-instruct"
API_KEY = "cluster-key"
READY_TIMEOUT_S = 180


@dataclass
class Cluster:
    url: str

    def http(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}
        )

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0)

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every sample of /metrics named `name`: (labels, value)."""
        text = self.http().get("/metrics").text
        return [
            (s.labels, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        ]

    def wait_healthy(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the replicated server never became healthy"
            time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(smollm_path: Path) -> Iterator[Cluster]:
    from tokenmill.cluster.app import ClusterSettings
    from tokenmill.cluster.launch import deploy, ray_session, undeploy

    settings = ClusterSettings(
        EngineArgs(model=str(smollm_path), kv_cache_memory="192MiB"),
        num_replicas=2,
        threads_per_replica=1,
        routing="prefix",
        served_model_name=MODEL_NAME,
        api_key=API_KEY,
        ui=False,
        shutdown_timeout_s=5,
    )
    with ray_session(None, num_cpus=2):
        server = Cluster(deploy(settings, "127.0.0.1", free_port()))
        server.wait_healthy()
        try:
            yield server
        finally:
            undeploy()
