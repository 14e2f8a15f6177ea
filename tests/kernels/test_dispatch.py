"""`dispatch.native_or`: an op's native call runs only with the extension loaded and inputs it
takes, its fallback otherwise; and `ops._NATIVE` is the one switch every op reads."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from tokenmill.kernels import dispatch, extension, ops


def fallback(x: int, scale: int = 1) -> str:
    return f"fallback {x * scale}"


@dispatch.native_or(fallback, fits=lambda x, scale=1: x >= 0)
def op(native, x: int, scale: int = 1) -> str:
    """The op's own docstring."""
    return native.double(x * scale)


FAKE_NATIVE = SimpleNamespace(double=lambda v: f"native {2 * v}")


def test_the_native_call_runs_on_inputs_that_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extension, "NATIVE", FAKE_NATIVE)
    assert op(3, scale=2) == "native 12"


def test_inputs_that_do_not_fit_run_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extension, "NATIVE", FAKE_NATIVE)
    assert op(-3, scale=2) == "fallback -6"


def test_without_the_extension_the_fallback_runs_and_fits_is_not_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked = []

    @dispatch.native_or(fallback, fits=lambda *args: asked.append(args) or True)
    def counted(native, x: int, scale: int = 1) -> str:
        return "native"

    monkeypatch.setattr(extension, "NATIVE", None)
    assert counted(5) == "fallback 5"
    assert asked == []


def test_the_op_keeps_its_name_docstring_and_signature_less_the_native_parameter() -> None:
    assert op.__doc__ == "The op's own docstring."
    assert op.__name__ == "op"
    assert list(inspect.signature(op).parameters) == ["x", "scale"]


def test_setting_ops_native_switches_the_extension_every_op_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ops, "_NATIVE", FAKE_NATIVE)
    assert extension.NATIVE is FAKE_NATIVE and ops._NATIVE is FAKE_NATIVE
    monkeypatch.setattr(ops, "_NATIVE", None)
    assert extension.NATIVE is None and ops.backend() == "torch"
