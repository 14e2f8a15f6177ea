"""Fixtures of the kernel tests."""

from __future__ import annotations

import pytest

from tokenmill.kernels import extension, ops


@pytest.fixture
def reloaded_ops(monkeypatch: pytest.MonkeyPatch):
    """Makes the import-time backend choice (`extension.load_native`) again under the test's
    patches and returns `ops` running on it; the real choice is restored afterwards."""

    def reload():
        monkeypatch.setattr(extension, "NATIVE", extension.load_native())
        return ops

    return reload


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch, reloaded_ops):
    """`ops` with TOKENMILL_KERNELS=torch taken as at import (the fallback), restored afterwards."""
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    return reloaded_ops()
