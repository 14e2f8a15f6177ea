"""The backend choice at import: TOKENMILL_KERNELS=torch, and a failed build, both leave every op
on its torch reference."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from torch.utils import cpp_extension

from tokenmill.kernels import build, ops

from .cases import random_paged_batch


def test_env_var_torch_selects_the_reference_kernels(
    monkeypatch: pytest.MonkeyPatch, reloaded_ops
) -> None:
    monkeypatch.setenv(ops.BACKEND_ENV, "torch")
    torch_ops = reloaded_ops()
    assert torch_ops.backend() == "torch"
    x, weight = torch.randn(3, 10), torch.randn(7, 10)
    assert torch.equal(torch_ops.linear(x, weight), F.linear(x, weight))
    q, kv_cache, tables, lens = random_paged_batch([20, 3], 4, 2)
    assert torch.equal(
        torch_ops.paged_decode_attention(q, kv_cache, tables, lens, 0.125),
        torch_ops.paged_decode_attention_reference(q, kv_cache, tables, lens, 0.125),
    )


def test_failed_build_warns_once_and_falls_back_to_torch(
    monkeypatch: pytest.MonkeyPatch, reloaded_ops, tmp_path, capsys
) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text("#error deliberately broken\n")

    def load_broken_source() -> None:
        # Its own name: reusing the real one would make torch rebuild the real extension later.
        cpp_extension.load(
            name="tokenmill_broken", sources=[str(broken)], build_directory=str(tmp_path)
        )

    monkeypatch.delenv(ops.BACKEND_ENV, raising=False)
    monkeypatch.setattr(build, "load_extension", load_broken_source)
    fallback_ops = reloaded_ops()
    warning_lines = capsys.readouterr().err.strip().splitlines()
    assert len(warning_lines) == 1 and "torch reference" in warning_lines[0]
    assert fallback_ops.backend() == "torch"
    x, weight, bias = torch.randn(1, 9), torch.randn(5, 9), torch.randn(5)
    assert torch.equal(fallback_ops.linear(x, weight, bias), F.linear(x, weight, bias))
