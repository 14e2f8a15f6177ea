"""Building and loading the extension: reuse of the built library, a stale lock, the pinned
ninja."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tokenmill.kernels import build

from .cases import needs_native


@needs_native
def test_loading_again_reuses_the_built_library() -> None:
    library = build.BUILD_DIR / f"{build.EXTENSION_NAME}.so"
    built_at = library.stat().st_mtime_ns
    build.load_extension()
    assert library.stat().st_mtime_ns == built_at


@needs_native
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load() -> None:
    """torch waits for its build lock without end; a build killed midway leaves one behind."""
    stale = build.BUILD_DIR / build.TORCH_LOCK_FILE
    stale.touch()
    load = "from tokenmill.kernels.build import load_extension; load_extension()"
    try:
        result = subprocess.run(
            [sys.executable, "-c", load], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        assert not stale.exists()
    finally:
        stale.unlink(missing_ok=True)


def test_builds_run_the_pinned_ninja_whatever_path_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ninja versions do not share a build log: alternating them rebuilt everything."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", "/bin"]))
    build._put_ninja_on_path()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
