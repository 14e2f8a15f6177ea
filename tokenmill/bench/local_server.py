"""A server process on this machine: a free loopback port, and waiting for its /health."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(
    server: subprocess.Popen[bytes], name: str, base_url: str, log: Path, timeout_s: float
) -> None:
    """Return once /health answers 200 (it answers 503 or nothing while the model loads); a
    RuntimeError with the tail of `log` if the process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited with {server.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{name} at {base_url} was not ready after {timeout_s:.0f} s; see {log}")


def stop(server: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL if it is not gone within `timeout_s`."""
    server.terminate()
    try:
        server.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
