"""Kernel timing for a profile (`tokenmill bench roofline`): while a recorder is installed,
every op called through `dispatch.native_or` and every native decode loop call report their
wall time to it. Without one (always, outside a profile) an op pays one check.

Only the outermost op is timed: an op another op calls (a dequantization inside a product, an
argmax inside the sampler) counts as its caller's time. The recorder is process-wide and meant
for one thread driving an engine offline.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch


class OpRecorder(Protocol):
    def op(self, name: str, args: tuple[Any, ...], result: Any, seconds: float) -> None:
        """One op call `name(*args) -> result` took `seconds`."""

    def decode_loop(
        self, owner: object, args: tuple[Any, ...], op_seconds: dict[str, float], seconds: float
    ) -> None:
        """One native decode loop call by `owner` on `args` (`DecodeLoop.run`'s) took `seconds`,
        of which `op_seconds` by kind of kernel (`DecodeLoop.OP_NAMES`)."""


RECORDER: OpRecorder | None = None
_inside_op = False


def install(recorder: OpRecorder | None) -> None:
    """Starts reporting to `recorder`, or stops (None)."""
    global RECORDER
    RECORDER = recorder


def timed_op(name: str, call: Callable[..., Any], args: tuple[Any, ...], kwargs: dict) -> Any:
    """`call(*args, **kwargs)`, reported to the recorder as op `name` unless an op is already
    running (then it is part of that one)."""
    global _inside_op
    recorder = RECORDER
    if recorder is None or _inside_op:
        return call(*args, **kwargs)
    _inside_op = True
    start = time.perf_counter()
    try:
        result = call(*args, **kwargs)
    finally:
        _inside_op = False
    recorder.op(name, args, result, time.perf_counter() - start)
    return result


def timed_decode_loop(owner: object, loop: Any, args: tuple[Any, ...]) -> Any:
    """`loop.run(*args)` with its per-kernel clock on, reported to the recorder."""
    recorder = RECORDER
    assert recorder is not None
    names = list(loop.OP_NAMES)
    op_ns = torch.zeros(len(names), dtype=torch.long)
    start = time.perf_counter()
    result = loop.run(*args, op_ns=op_ns)
    seconds = time.perf_counter() - start
    op_seconds = {name: ns / 1e9 for name, ns in zip(names, op_ns.tolist(), strict=True)}
    recorder.decode_loop(owner, args, op_seconds, seconds)
    return result
