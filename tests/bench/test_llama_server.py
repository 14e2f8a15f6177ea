"""The llama-server wrapper's failure paths; building it takes CPU-minutes, so no test does."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.llama_server import (
    BUILD_ID,
    LLAMA_CPP_PYTHON,
    ensure_llama_server,
    running_llama_server,
)
from tokenmill.bench.local_server import free_port


def test_missing_build_without_install_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no llama-server"):
        ensure_llama_server(tmp_path, install=False, jobs=1)


def test_a_build_made_with_other_options_is_made_again(tmp_path):
    """Only a stamp naming this source and these options reuses a build."""
    binary = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.touch()
    stamp = binary.parent.parent / ".tokenmill-built"
    stamp.write_text(LLAMA_CPP_PYTHON)  # how builds before the AMX flags were stamped
    with pytest.raises(ValueError, match="no llama-server"):
        ensure_llama_server(tmp_path, install=False, jobs=1)
    stamp.write_text(BUILD_ID)
    assert ensure_llama_server(tmp_path, install=False, jobs=1) == binary


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with (
        pytest.raises(RuntimeError, match="exited with 1"),
        running_llama_server(Path("/bin/false"), tmp_path / "m.gguf", 1, 256, 1, log),
    ):
        pass


def test_free_port_is_a_usable_port_number():
    assert 0 < free_port() < 65536
