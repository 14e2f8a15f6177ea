"""Streams the serving code reads like the engine's RequestStream: a finished answer replayed
(a cache hit, a cascade's small answer), and an engine stream whose final answer is kept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.outputs import RequestOutput


class ReplayStream(RequestStream):
    """A finished RequestOutput as a stream of one output, under the caller's request id.
    (A RequestStream, so the serving code takes it like any engine stream.)"""

    def __init__(self, output: RequestOutput, request_id: str) -> None:
        super().__init__(request_id, engine=None)  # type: ignore[arg-type]  # nothing to abort
        self.put(replace(output, request_id=request_id))

    def close(self) -> None:
        self.finished = True


class RecordingStream(RequestStream):
    """An engine stream that hands its finished output to `on_finished` on the way through."""

    def __init__(self, inner: RequestStream, on_finished: Callable[[RequestOutput], None]) -> None:
        super().__init__(inner.request_id, engine=None)  # type: ignore[arg-type]
        self._inner = inner
        self._on_finished = on_finished

    async def __anext__(self) -> RequestOutput:
        output = await self._inner.__anext__()
        self.finished = self._inner.finished
        if output.finished:
            self._on_finished(output)
        return output

    def close(self) -> None:
        self.finished = True
        self._inner.close()


async def final_output(stream: RequestStream) -> RequestOutput:
    """Run a stream to its end; closing it however this ends (an abort frees its blocks)."""
    final = None
    try:
        async for output in stream:
            final = output
    finally:
        stream.close()
    if final is None:
        raise RuntimeError(f"request {stream.request_id} ended without an output")
    return final
