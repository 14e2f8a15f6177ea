"""The prefix-aware request router, plugged into Ray Serve's request-router API: Serve asks it
to rank the engine replicas for each request, probes their queues and sends the request to
the first one that accepts. The policy is PrefixIndex's; this class only feeds it Serve's view
(candidate replicas, their queue lengths, which replica a request went to, which one died).

It lives in the caller's process (the ingress), so each ingress replica keeps its own index: an
approximation, as SGLang's router is, that costs no round trip per request.
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from tokenmill.cluster.prefix_index import PrefixIndex, PrefixPolicy, prefix_keys

ROUTER_PATH = "tokenmill.cluster.prefix_router.PrefixAffinityRouter"


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, **policy: Any) -> None:
        """`policy`: PrefixPolicy's fields (Serve passes `request_router_kwargs` here)."""
        self._index = PrefixIndex(PrefixPolicy(**policy))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        loads = await self._queue_lens(candidate_replicas)
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = self._index.choose(self._keys(pending_request), loads)
        return [[by_id[replica_id]] for replica_id in ranked]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        self._index.record(replica_id, self._keys(pending_request))

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id)

    def _keys(self, pending_request: PendingRequest | None) -> list[int]:
        """The prefix keys of an engine call's prompt (none for other calls)."""
        if pending_request is None or not pending_request.args:
            return []
        token_ids = getattr(pending_request.args[0], "prompt_token_ids", None)
        if not token_ids:
            return []
        return prefix_keys(token_ids, self._index.policy.chunk_tokens)

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Serve's cached queue lengths, probing the replicas it has none for (an unanswered
        probe counts as full, so the replica ranks last)."""
        cache = self.replica_queue_len_cache
        loads = {r.replica_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if loads[r.replica_id] is None]
        if missing:
            for replica, queue_len in await self._probe_queue_lens(missing, 0):
                loads[replica.replica_id] = queue_len
        return {
            r.replica_id: r.max_ongoing_requests
            if loads[r.replica_id] is None
            else loads[r.replica_id]
            for r in replicas
        }
