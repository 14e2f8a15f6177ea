"""Compiling and loading the native kernels, a torch C++ extension cached inside the repo.

`scripts/build_kernels.py` builds it once at install; later loads find the compiled library in
`BUILD_DIR` and ninja sees nothing to rebuild unless a source or header changed.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import ModuleType

from torch.utils import cpp_extension

CSRC_DIR = Path(__file__).parent / "csrc"
BUILD_DIR = Path(__file__).parent / "_build"
EXTENSION_NAME = "tokenmill_kernels"
TORCH_LOCK_FILE = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory
# AVX2 + FMA is the widest x86 SIMD every machine we target has; F16C (fp16 scales of quantized
# weights) comes with every AVX2 CPU. The AVX-512 paths are compiled per function (a `target`
# attribute or pragma) and chosen at run time, so one library serves every CPU.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]


def load_extension(verbose: bool = False) -> ModuleType:
    """Builds the extension if its sources changed, then imports it. Raises on any failure.

    torch guards a build with a `lock` file in the build directory and waits, without end or a
    word, while one exists; a build killed midway (Ctrl-C in the first run) leaves it behind,
    and every later start would hang. So our processes take turns on an flock first, which the
    OS releases when its holder dies: whoever holds it is the only one building, and a `lock`
    file it finds is stale."""
    _put_ninja_on_path()
    BUILD_DIR.mkdir(exist_ok=True)
    with open(BUILD_DIR / "build.flock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        (BUILD_DIR / TORCH_LOCK_FILE).unlink(missing_ok=True)
        return cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(path) for path in sorted(CSRC_DIR.glob("*.cpp"))],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(BUILD_DIR),
            verbose=verbose,
        )


def _put_ninja_on_path() -> None:
    """torch runs whichever `ninja` comes first on PATH. A machine may have its own besides the
    pinned pip one, which is first on PATH only in an activated venv; two ninja versions do not
    share a build log, so each rebuilt everything the other had built, a full build at every
    start that switched. The pinned one goes first, always."""
    try:
        import ninja  # the pinned pip package; imported late because only a build needs it
    except ImportError:  # an install without it: whatever ninja PATH has
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != ninja.BIN_DIR:
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
