"""The engine replicas, seen from the ingress in the shape of the AsyncLLMEngine the server's
endpoints call: `add_request` hands a prompt to a replica Serve's router picks and returns a
stream of its outputs; `engine` answers what the endpoints ask of the model (tokenizer, context
length, grammar compilation for a 400 before anything runs) without loading its weights.

A replica that dies mid-stream ends its streams with ReplicaLostError (the client sees an
error event or a 500, never a hang); a stream closed early cancels the replica's generator,
which aborts the request there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from tokenmill.cluster.board import REPORT_PERIOD_S, ReplicaReport
from tokenmill.cluster.cluster_metrics import ClusterMetrics
from tokenmill.cluster.replica import ACCEPTED, EngineCall, ModelFacts
from tokenmill.engine.async_engine import EngineBusyError, EngineStoppedError, RequestStream
from tokenmill.engine.engine import PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.loader.tokenizer import Tokenizer
from tokenmill.sampling.params import SamplingParams
from tokenmill.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

PASSED_THROUGH = (ValueError, EngineBusyError, EngineStoppedError)
"""Errors of a replica's engine the endpoints turn into a 400 or a 503, as they do locally."""


class ReplicaLostError(RuntimeError):
    """The replica running a request died or became unreachable before the request ended."""


@dataclass
class ModelView:
    """The model as the endpoints read it through `ctx.engine.engine`."""

    facts: ModelFacts
    tokenizer: Tokenizer
    structured: StructuredOutputManager

    @property
    def max_seq_len(self) -> int:
        return self.facts.max_seq_len

    @classmethod
    def of(cls, facts: ModelFacts, tokenizer: Tokenizer) -> ModelView:
        return cls(facts, tokenizer, StructuredOutputManager(tokenizer, facts.vocab_size))


class RemoteStream(RequestStream):
    """A request's outputs as a replica streams them."""

    def __init__(self, request_id: str, generator: DeploymentResponseGenerator) -> None:
        self.request_id = request_id
        self.finished = False
        self._generator = generator

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._generator.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise ReplicaLostError(
                "the replica ended the stream before the request finished"
            ) from None
        except Exception as exc:
            self.finished = True
            raise _local_error(exc) from exc
        self.finished = output.finished
        return output

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self._generator.cancel()

    def put(self, item: RequestOutput | BaseException) -> None:
        raise TypeError("a replica fills this stream")


class RemoteEngine:
    def __init__(
        self,
        handle: DeploymentHandle,
        model: ModelView,
        board: Any,
        num_replicas: int,
    ) -> None:
        self.handle = handle.options(stream=True)
        self.engine = model
        self._board = board
        self._reports: Mapping[int, ReplicaReport] = {}
        self.metrics = ClusterMetrics(lambda: self._reports, num_replicas)
        self._poller: asyncio.Task[None] | None = None

    @property
    def is_running(self) -> bool:
        """Every replica the deployment asks for reports a running engine."""
        return self.metrics.replicas_up() >= self.metrics.num_replicas

    def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def shutdown(self) -> None:
        if self._poller is not None:
            self._poller.cancel()

    async def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams
    ) -> RemoteStream:
        """Returns once a replica's engine took the request; its refusal raises here."""
        call = EngineCall(request_id, prompt, params)
        generator = self.handle.generate.remote(call)
        try:
            first = await generator.__anext__()
        except asyncio.CancelledError:
            generator.cancel()
            raise
        except Exception as exc:
            raise _local_error(exc) from exc
        assert first == ACCEPTED, first
        return RemoteStream(request_id, generator)

    async def _poll_forever(self) -> None:
        while True:
            try:
                self._reports = await self._board.reports.remote()
            except Exception:
                logger.warning("reading the replica board failed", exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)


def _local_error(exc: BaseException) -> BaseException:
    """What a replica's failure means here: its engine's own error when the endpoints know it,
    busy when Serve's queue is full, else the replica was lost."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, PASSED_THROUGH):
        return cause
    if isinstance(exc, PASSED_THROUGH):
        return exc
    if isinstance(exc, BackPressureError):
        return EngineBusyError(str(exc))
    if isinstance(exc, RayError):
        return ReplicaLostError(f"the replica serving this request failed: {exc}")
    return exc
