"""`tokenmill serve` as a user starts it, in a process of its own on a free loopback port."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

from tokenmill.bench.local_server import free_port, stop, wait_until_healthy
from tokenmill.config import EngineArgs


def engine_flags(args: EngineArgs) -> list[str]:
    """The command-line flags that give `args` back: each field's flag is its name with
    dashes, a bool is `--name` or `--no-name`, and None is the flag left out (its default)."""
    flags: list[str] = []
    for field in fields(EngineArgs):
        value = getattr(args, field.name)
        flag = "--" + field.name.replace("_", "-")
        if value is None:
            if field.default is not None:
                raise ValueError(f"{field.name}=None has no {flag} flag to say it")
            continue
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def running_tokenmill_server(args: EngineArgs, log: Path, timeout_s: float = 600) -> Iterator[str]:
    """Start `tokenmill serve` with `args` on 127.0.0.1, yield its base URL once /health says
    it is ready, stop it afterwards. The server's own output goes to `log`."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1"]
    command += ["--port", str(port), *engine_flags(args)]
    base_url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(server, "tokenmill serve", base_url, log, timeout_s)
            yield base_url
        finally:
            stop(server)
