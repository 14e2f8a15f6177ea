"""Build the native kernels ahead of time so importing tokenmill never waits for a compiler.

Run by the install step: `.venv/bin/python scripts/build_kernels.py`. Exits non-zero when the
build fails; tokenmill still works then, on the torch reference kernels.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    start = time.perf_counter()
    # Importing the tokenmill package would otherwise build and load the extension through
    # tokenmill.kernels.extension, and after a failed build there, torch's loader, asked again in
    # the same process, skips the build it remembers and imports the stale library: a broken
    # source would be reported ready. So the import takes the reference kernels, and the build below
    # is the only one.
    os.environ["TOKENMILL_KERNELS"] = "torch"
    try:
        from tokenmill.kernels.build import BUILD_DIR, load_extension

        load_extension(verbose="-v" in sys.argv)
    except Exception as exc:  # a compiler error is reported, not raised: the torch path remains
        print(f"native kernels failed to build: {exc}", file=sys.stderr)
        return 1
    print(f"native kernels ready in {BUILD_DIR} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
