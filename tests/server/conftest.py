"""Live servers for the server tests: uvicorn on 127.0.0.1 at a free port, in a thread of the test
process, around an engine on the session's loaded SmolLM2 (so each server costs no model load)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from tokenmill.config import EngineArgs
from tokenmill.engine.engine import LLMEngine
from tokenmill.loader.model_loader import LoadedModel
from tokenmill.server.app import build_app

MODEL_NAME = "smollm2-135m-instruct"
API_KEY = "test-key"


@dataclass
class LiveServer:
    url: str
    engine: LLMEngine

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120, **kwargs)

    def openai(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def metric(self, name: str, headers: dict[str, str] | None = None) -> float:
        """One unlabelled sample of /metrics."""
        text = httpx.get(f"{self.url}/metrics", headers=headers).text
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    def metric_with_labels(self, name: str, **labels: str) -> float:
        """The sample of /metrics with exactly these labels (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return sample.value
        return 0.0

    def wait_until_idle(self, headers: dict[str, str] | None = None, timeout_s: float = 30) -> None:
        """Until /metrics shows no request running or waiting and no KV block held by one."""
        names = (
            "tokenmill_num_requests_running",
            "tokenmill_num_requests_waiting",
            "tokenmill_kv_cache_blocks_in_use",
        )
        deadline = time.monotonic() + timeout_s
        while True:
            values = {name: self.metric(name, headers) for name in names}
            if not any(values.values()):
                return
            assert time.monotonic() < deadline, f"still busy: {values}"
            time.sleep(0.05)


def make_engine(loaded: LoadedModel, **kwargs) -> LLMEngine:
    args = EngineArgs(model=str(loaded.path), **{"kv_cache_memory": "256MiB", **kwargs})
    return LLMEngine(args, loaded=loaded)


@contextmanager
def live_server(engine: LLMEngine, **app_kwargs) -> Iterator[LiveServer]:
    app = build_app(engine, MODEL_NAME, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        thread.join(timeout=60)
        sock.close()


@pytest.fixture(scope="module")
def server(smollm: LoadedModel) -> Iterator[LiveServer]:
    """The default server of a test module."""
    with live_server(make_engine(smollm)) as live:
        yield live


@pytest.fixture(scope="session")
def start_server(smollm: LoadedModel):
    """`start_server(engine_kwargs, app_kwargs)`: a context manager for a server of its own."""

    def start(engine_kwargs: dict | None = None, **app_kwargs):
        return live_server(make_engine(smollm, **(engine_kwargs or {})), **app_kwargs)

    return start


@pytest.fixture(scope="session")
def serve_engines():
    """`serve_engines(engines, **app_kwargs)`: a context manager for a server over these engines
    (a dict of them, by name, serves several models), and `serve_engines.engine(loaded, **kw)`
    an engine to put in it."""

    def start(engines, **app_kwargs):
        return live_server(engines, **app_kwargs)

    start.engine = make_engine
    return start
