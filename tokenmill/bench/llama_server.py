"""llama.cpp's `llama-server`, built from the llama.cpp that llama-cpp-python vendors.

llama-cpp-python's wheel ships only the library, so the server is built from its source
distribution: pip downloads the pinned sdist, CMake (from PyPI, in the anchor's venv) builds
two targets: `llama-server` and `llama-bench`. With several parallel slots the server batches
continuously, which makes it the llama.cpp a serving comparison should face; `llama-bench` is
llama.cpp's own single-stream figure (its tg128 and pp256 rows) on the same build.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

from tokenmill.bench.local_server import free_port, stop, wait_until_healthy
from tokenmill.bench.venvs import VenvSpec, ensure_venv, run_checked

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
BUILD_TOOLS = VenvSpec("llama.cpp", ("cmake==4.4.4",))
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # the vector extensions of the machine that runs it, but not AMX:
    # built with it, llama-server can die on SIGILL in its AMX kernel on a VM that grants AMX
    # tiles only to a process that asks for them (tokenmill's own kernels do ask)
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",  # no npm; an empty web UI
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # and no download of a prebuilt one
)
TARGETS = ("llama-server", "llama-bench")
# What the stamp of a finished build records: a build made from another source, with other
# options or of other targets is made again.
BUILD_ID = " ".join((LLAMA_CPP_PYTHON, *CMAKE_OPTIONS, *TARGETS))


def ensure_llama_server(cache_dir: Path, install: bool, jobs: int) -> Path:
    """Path of the built llama-server binary, building it first if needed (a long compile,
    done once per cache directory and options); `llama-bench` sits beside it."""
    home = cache_dir / BUILD_TOOLS.name
    binary = home / "build" / "bin" / "llama-server"
    stamp = home / "build" / ".tokenmill-built"
    if binary.is_file() and stamp.is_file() and stamp.read_text() == BUILD_ID:
        return binary
    if not install:
        raise ValueError(
            f"llama.cpp: no llama-server at {binary}; run once without --no-install to build it"
        )
    python = ensure_venv(BUILD_TOOLS, cache_dir, install)
    source = _vendored_llama_cpp(python, home / "src")
    build = home / "build"
    cmake = str(python.parent / "cmake")
    print(f"anchors: building llama-server from {source} (minutes)", file=sys.stderr)
    run_checked([cmake, "-S", str(source), "-B", str(build), *CMAKE_OPTIONS])
    run_checked([cmake, "--build", str(build), "--target", *TARGETS, "-j", str(jobs)])
    stamp.write_text(BUILD_ID)
    return binary


def _vendored_llama_cpp(python: Path, src_dir: Path) -> Path:
    """Download and unpack the pinned llama-cpp-python sdist; its vendor/llama.cpp directory."""
    src_dir.mkdir(parents=True, exist_ok=True)
    archives = sorted(src_dir.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        run_checked(
            [
                str(python),
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                "--dest",
                str(src_dir),
                LLAMA_CPP_PYTHON,
            ]
        )
        archives = sorted(src_dir.glob("llama_cpp_python-*.tar.gz"))
    unpacked = src_dir / archives[-1].name.removesuffix(".tar.gz")
    if not unpacked.is_dir():
        with tarfile.open(archives[-1]) as archive:
            archive.extractall(src_dir, filter="data")
    return unpacked / "vendor" / "llama.cpp"


@contextlib.contextmanager
def running_llama_server(
    binary: Path, gguf: Path, slots: int, slot_context: int, threads: int, log: Path
) -> Iterator[str]:
    """Start llama-server on a free local port, yield its base URL once /health says it is
    ready, stop it afterwards. Each of `slots` parallel sequences gets `slot_context` tokens;
    the server's own output goes to `log`."""
    port = free_port()
    command = [
        str(binary),
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * slot_context),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--cont-batching",
        "--no-webui",
    ]
    base_url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(server, "llama-server", base_url, log, timeout_s=300)
            yield base_url
        finally:
            stop(server, timeout_s=30)
