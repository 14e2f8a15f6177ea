"""One engine replica: an LLMEngine behind AsyncLLMEngine in a Ray Serve replica, pinned to its
own cores. The ingress calls `generate` through a streaming DeploymentHandle; the stream's first
item says the engine took the request (so a refusal surfaces before any response is sent), the
rest are the request's cumulative outputs. A cancelled stream (client gone) aborts the request.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ray import serve

from tokenmill.cluster.board import REPORT_PERIOD_S, get_board
from tokenmill.cluster.pinning import pin_replica
from tokenmill.config import EngineArgs
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.engine import LLMEngine, PromptInput
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

ACCEPTED = "accepted"


@dataclass(frozen=True)
class EngineCall:
    """One prompt for a replica; the router reads `prompt_token_ids` to find its prefix."""

    request_id: str
    prompt: PromptInput
    params: SamplingParams

    @property
    def prompt_token_ids(self) -> list[int]:
        prompt = self.prompt
        return list(prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []


@dataclass(frozen=True)
class ModelFacts:
    """What the ingress needs of the model to check requests without loading it."""

    model: str
    max_seq_len: int
    vocab_size: int


class EngineReplica:
    def __init__(self, args: EngineArgs, threads: int, max_waiting_requests: int | None) -> None:
        context = serve.get_replica_context()
        self.rank = context.rank.rank
        self.replica_id = context.replica_tag
        self.cores = pin_replica(context.rank.local_rank, threads)
        self.engine = LLMEngine(args)
        self.async_engine = AsyncLLMEngine(self.engine, max_waiting_requests)
        self._board = get_board(context.app_name)
        self._reporter: asyncio.Task[None] | None = None
        logger.info("replica %d: threads=%d cores=%s", self.rank, threads, self.cores)

    def _ensure_started(self) -> None:
        """Start the engine loop and the reports on the replica's event loop, at first use."""
        if self._reporter is None:
            self.async_engine.start()
            self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def generate(self, call: EngineCall) -> AsyncIterator[str | RequestOutput]:
        self._ensure_started()
        stream = await self.async_engine.add_request(call.request_id, call.prompt, call.params)
        try:
            yield ACCEPTED
            async for output in stream:
                yield output
        finally:
            stream.close()  # aborts the request unless it finished

    async def facts(self) -> ModelFacts:
        engine = self.engine
        return ModelFacts(engine.args.model, engine.max_seq_len, engine.loaded.config.vocab_size)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop stopped is restarted."""
        self._ensure_started()
        if not self.async_engine.is_running:
            raise RuntimeError(f"replica {self.rank}: the engine loop stopped")

    async def __del__(self) -> None:
        """Serve calls this on shutdown, after in-flight requests drained (or timed out)."""
        if self._reporter is not None:
            self._reporter.cancel()
            await self.async_engine.shutdown()
        self.engine.close()

    async def _report_forever(self) -> None:
        while True:
            await self._post_report()
            await asyncio.sleep(REPORT_PERIOD_S)

    async def _post_report(self) -> None:
        metrics = self.async_engine.metrics
        report: dict[str, Any] = {
            "families": list(metrics.registry.collect()),
            "summary": {**metrics.summary(), "cores": self.cores},
            "running": self.async_engine.is_running,
        }
        try:
            await self._board.post.remote(self.rank, self.replica_id, os.getpid(), **report)
        except Exception:  # the board is being replaced or the app shuts down: next period
            logger.warning("replica %d: posting its report failed", self.rank, exc_info=True)
