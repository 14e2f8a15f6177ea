"""Streams the serving code reads like the engine's RequestStream: a finished answer replayed
step by step (a cache hit, a cascade's small answer), and an engine stream whose final answer
and steps are kept."""

from __future__ import annotations

from array import array
from collections.abc import Callable

from tokenmill.engine.async_engine import RequestStream
from tokenmill.engine.outputs import RequestOutput
from tokenmill.gateway.transcript import Recorder, replay

Finished = Callable[[RequestOutput, array], None]
"""Told a stream's final output and the steps it grew by."""


class ReplayStream(RequestStream):
    """A finished answer as the stream of cumulative outputs it was generated as, under the
    caller's request id. (A RequestStream, so the serving code takes it like any engine
    stream.)"""

    def __init__(self, final: RequestOutput, steps: array, request_id: str) -> None:
        super().__init__(request_id, engine=None)  # type: ignore[arg-type]  # nothing to abort
        self.final = final
        self.steps = steps
        for output in replay(final, self.steps, request_id):
            self.put(output)

    def close(self) -> None:
        self.finished = True


class RecordingStream(RequestStream):
    """An engine stream that hands its final output and steps to `on_finished` on the way
    through."""

    def __init__(self, inner: RequestStream, on_finished: Finished) -> None:
        super().__init__(inner.request_id, engine=None)  # type: ignore[arg-type]
        self._inner = inner
        self._on_finished = on_finished
        self._recorder = Recorder()

    async def __anext__(self) -> RequestOutput:
        output = await self._inner.__anext__()
        self.finished = self._inner.finished
        self._recorder.see(output)
        if output.finished:
            self._on_finished(output, self._recorder.steps)
        return output

    def close(self) -> None:
        self.finished = True
        self._inner.close()


async def record(stream: RequestStream) -> tuple[RequestOutput, array]:
    """Run a stream to its end: its final output and the steps it grew by; the stream is
    closed however this ends (an abort frees its blocks)."""
    final, recorder = None, Recorder()
    try:
        async for output in stream:
            final = output
            recorder.see(output)
    finally:
        stream.close()
    if final is None:
        raise RuntimeError(f"request {stream.request_id} ended without an output")
    return final, recorder.steps
