#!/usr/bin/env bash
# Run ruff, then the whole test suite. Each test directory runs in its own pytest process: the
# session fixtures load real models (fp32, bf16, every quantization, Gemma, the HF oracles), and
# one process for everything would hold them all at once. Every directory runs even after a
# failure; any non-zero pytest exit fails the suite, including 5 ("no tests collected").
# Arguments, when given, go to one pytest run instead: `bash scripts/test.sh tests/kv -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check tokenmill tests scripts
if [ "$#" -gt 0 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
failed=()
for target in tests/*/ "tests/test_*.py"; do
    # a directory without test files (__pycache__, data) is not a test directory
    if [ -d "${target}" ] && [ -z "$(find "${target}" -name 'test_*.py' -print -quit)" ]; then
        continue
    fi
    # shellcheck disable=SC2086  # the last target is a glob pytest receives as several files
    if ! .venv/bin/python -m pytest -q ${target}; then
        failed+=("${target}")
    fi
done
if [ "${#failed[@]}" -gt 0 ]; then
    echo "failed: ${failed[*]}" >&2
    exit 1
fi
