"""AsyncLLMEngine: many asyncio callers, one LLMEngine, one loop stepping it while work exists.

LLMEngine is not thread-safe, so every change to it (add, abort) is applied by the loop on the
event-loop thread between steps; only `step()` itself runs in a worker thread, which keeps the
event loop accepting and streaming while the model computes. Each request has its own queue of
cumulative RequestOutputs. A step that raises fails the requests it held, frees their blocks,
and the loop carries on with new ones.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.metrics import EngineMetrics, EngineStats
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.001
"""Between steps that ran nothing while requests wait to be batched."""


class EngineBusyError(RuntimeError):
    """Too many requests are already waiting: the caller should retry later."""


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class RequestStream:
    """The cumulative outputs of one request, ending with a finished one. Closing the stream
    before that aborts the request, so an abandoned stream never holds KV blocks."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)


@dataclass
class _PendingAdd:
    request_id: str
    prompt: PromptInput
    params: SamplingParams
    stream: RequestStream
    accepted: asyncio.Future[None]
    arrival: float = field(default_factory=time.monotonic)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        """`max_waiting_requests`: beyond this many queued requests, `add_request` raises
        EngineBusyError instead of letting the queue grow without bound (None: no limit)."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.stats = EngineStats.of(engine)
        self.metrics = EngineMetrics(lambda: self.stats)
        self._streams: dict[str, RequestStream] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-step")
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def is_running(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    @property
    def num_waiting(self) -> int:
        return self.stats.num_waiting + len(self._pending_adds)

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the loop after its current step."""
        self._stopping = True
        self._wake.set()
        if self._loop_task is not None:
            await self._loop_task
        self._executor.shutdown(wait=True)

    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> RequestStream:
        """Hand a request to the loop; returns once the engine took it (ValueError if the engine
        rejected it, EngineBusyError if too many requests wait already)."""
        if self._stopping or not self.is_running:
            raise EngineStoppedError("the engine is not running")
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise EngineBusyError(
                f"{self.num_waiting} requests are waiting already "
                f"(max_waiting_requests={self.max_waiting_requests})"
            )
        stream = RequestStream(request_id, self)
        accepted = asyncio.get_running_loop().create_future()
        self._pending_adds.append(_PendingAdd(request_id, prompt, params, stream, accepted))
        self._wake.set()
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Cancel a request; the loop frees its blocks before the next step."""
        pending = [add for add in self._pending_adds if add.request_id == request_id]
        for add in pending:
            self._pending_adds.remove(add)
            add.accepted.cancel()
        if not pending:
            self._pending_aborts.append(request_id)
            self._wake.set()

    async def _run(self) -> None:
        try:
            await self._step_while_work_exists()
        except BaseException as exc:
            logger.exception("the engine loop stopped")
            self._end_all(exc, "error")
            raise

    async def _step_while_work_exists(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._apply_pending()
            if self._stopping:
                self._end_all(EngineStoppedError("the engine shut down"), "abort")
                return
            if not self.engine.has_unfinished_requests():
                self._wake.clear()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception as exc:
                logger.exception("engine step failed; failing the requests in flight")
                self._end_all(exc, "error")
            else:
                self.metrics.step_done(self.engine.last_step_num_requests)
                self._dispatch(outputs)
                if self.engine.has_unfinished_requests() and not self.engine.scheduler.running:
                    # Work waits, but no batch runs: a batch policy is holding its requests
                    # back (the dynamic batcher filling a batch). Poll gently, not flat out.
                    await asyncio.sleep(IDLE_POLL_S)
            self.stats = EngineStats.of(self.engine)

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for add in adds:
            if add.accepted.done():  # the caller gave up while waiting
                continue
            try:
                self.engine.add_request(add.request_id, add.prompt, add.params)
            except Exception as exc:
                add.accepted.set_exception(exc)
                continue
            self._streams[add.request_id] = add.stream
            self.metrics.request_added(add.request_id, add.arrival, add.params.n)
            add.accepted.set_result(None)
        aborts, self._pending_aborts = self._pending_aborts, []
        for request_id in aborts:
            if self._streams.pop(request_id, None) is not None:
                self.engine.abort_request(request_id)
                self.metrics.request_ended(request_id, "abort")
        self.stats = EngineStats.of(self.engine)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for output in outputs:
            self.metrics.request_output(output, now)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put(output)

    def _end_all(self, error: BaseException, reason: str) -> None:
        """Fail every request in flight and free its blocks: the engine is empty afterwards."""
        for request_id, stream in self._streams.items():
            self.engine.abort_request(request_id)
            self.metrics.request_ended(request_id, reason)
            stream.put(error)
        self._streams.clear()
        self.stats = EngineStats.of(self.engine)
