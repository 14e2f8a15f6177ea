"""`tokenmill serve --replicas` as a user starts it: SIGTERM drains the request in flight, then
the command exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx

from tokenmill.bench.local_server import free_port

READY_TIMEOUT_S = 180


def test_sigterm_drains_the_request_in_flight_then_exits_cleanly(smollm_path):
    port = free_port()
    argv = [sys.executable, "-m", "tokenmill.cli", "serve", "--replicas", "1", "--routing"]
    argv += ["pow2", "--port", str(port), "--model", str(smollm_path)]
    argv += ["--kv-cache-memory", "64MiB", "--no-ui"]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "never became healthy"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        answers: list[httpx.Response] = []
        body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
        request = threading.Thread(
            target=lambda: answers.append(
                httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            )
        )
        request.start()
        time.sleep(1.0)  # the request is running on the replica
        server.send_signal(signal.SIGTERM)
        request.join()
        assert server.wait(timeout=120) == 0
        assert answers[0].status_code == 200
        assert answers[0].json()["usage"]["completion_tokens"] == 40
    finally:
        if server.poll() is None:
            server.kill()
