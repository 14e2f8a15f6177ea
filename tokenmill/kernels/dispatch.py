"""The one rule every op follows: its native kernel when the extension loaded and takes the
inputs, else its fallback (the torch reference, or None for a native-only handle).

An op is written as its native call, `def op(native, *args)`, under `@native_or(fallback, fits)`;
`fits(*args)` says whether the native kernel takes these inputs. The predicates below are the
usual `fits` parts: they run on every call, so they stick to the cheapest tensor attributes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from tokenmill.kernels import extension, op_timer


def native_or(
    fallback: Callable[..., Any], fits: Callable[..., bool] | None = None
) -> Callable[[Callable[..., Any]], Any]:
    """Turns `native_call(native, *args)` into the op `op(*args)`: `native_call` with the
    extension module when it loaded and `fits(*args)` holds (always, without `fits`), else
    `fallback(*args)`. The op keeps `native_call`'s name, docstring and signature, less its
    `native` parameter. While a profile records (`op_timer`), the op reports its time."""

    def decorate(native_call: Callable[..., Any]) -> Callable[..., Any]:
        name = native_call.__name__

        def run(*args: Any, **kwargs: Any) -> Any:
            native = extension.NATIVE
            if native is None or (fits is not None and not fits(*args, **kwargs)):
                return fallback(*args, **kwargs)
            return native_call(native, *args, **kwargs)

        def op(*args: Any, **kwargs: Any) -> Any:
            if op_timer.RECORDER is not None:  # a profile is on (tokenmill bench roofline)
                return op_timer.timed_op(name, run, args, kwargs)
            return run(*args, **kwargs)

        functools.update_wrapper(op, native_call)
        signature = inspect.signature(native_call)
        public = list(signature.parameters.values())[1:]
        op.__signature__ = signature.replace(parameters=public)  # type: ignore[attr-defined]
        return op

    return decorate


def no_native_kernel(*args: Any, **kwargs: Any) -> None:
    """The fallback of a native-only handle: there is none without the extension."""
    return None


def native_friendly(tensors: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32) -> bool:
    """CPU tensors of `dtype` outside autograd: float32 is the case the native kernels implement;
    a bfloat16 model's kernels (products on AMX, norms, activation, rotary embedding, KV stores
    and decode attention) also take bfloat16.

    Runs on every call, so it sticks to the cheapest tensor attributes (`is_cpu`, not `device`).
    """
    grad_enabled = torch.is_grad_enabled()
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or (grad_enabled and t.requires_grad):
            return False
    return True


def float32_or_bfloat16(tensors: tuple[torch.Tensor, ...]) -> bool:
    """`native_friendly` for kernels that take a float32 or a bfloat16 model's tensors, all of
    one dtype."""
    return native_friendly(tensors, tensors[0].dtype) and tensors[0].dtype in (
        torch.float32,
        torch.bfloat16,
    )
