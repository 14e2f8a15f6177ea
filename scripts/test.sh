#!/usr/bin/env bash
# Run the whole test suite and the linter. pytest's "no tests collected" (exit 5) fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check tokenmill tests scripts
.venv/bin/python -m pytest -q "$@"
