"""The replica board: a small Ray actor where every engine replica posts, every REPORT_PERIOD_S,
its Prometheus series, its JSON summary and whether its engine loop runs. The ingress reads it
for /metrics, /v1/metrics and /health, since a Serve handle reaches one replica, never all.

A report older than STALE_S is a replica that stopped reporting (dead, or restarting)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
from prometheus_client.core import Metric

REPORT_PERIOD_S = 0.5
STALE_S = 5.0
NAMESPACE = "tokenmill"


@dataclass(frozen=True)
class ReplicaReport:
    rank: int
    replica_id: str
    pid: int
    families: list[Metric]
    summary: dict[str, Any]
    running: bool
    at: float  # wall-clock seconds, the board's own clock

    @property
    def fresh(self) -> bool:
        return time.time() - self.at < STALE_S


@ray.remote(num_cpus=0)
class ReplicaBoard:
    def __init__(self) -> None:
        self._reports: dict[int, ReplicaReport] = {}

    def post(
        self,
        rank: int,
        replica_id: str,
        pid: int,
        families: list[Metric],
        summary: dict[str, Any],
        running: bool,
    ) -> None:
        self._reports[rank] = ReplicaReport(
            rank, replica_id, pid, families, summary, running, time.time()
        )

    def reports(self) -> dict[int, ReplicaReport]:
        return dict(self._reports)

    def forget_ranks_from(self, num_replicas: int) -> None:
        """Drop the ranks a scale-down removed."""
        for rank in [r for r in self._reports if r >= num_replicas]:
            del self._reports[rank]


def board_name(app_name: str) -> str:
    return f"replica-board-{app_name}"


def get_board(app_name: str) -> Any:
    """The app's board, created by whoever asks first; detached, so a replica restart keeps it
    (the launcher kills it on shutdown)."""
    return ReplicaBoard.options(
        name=board_name(app_name), namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote()
