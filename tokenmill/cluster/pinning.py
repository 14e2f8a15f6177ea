"""One replica's share of its machine: T compute threads on T cores no other replica of the node
uses, so replicas do not steal each other's cache and cycles."""

from __future__ import annotations

import os

import torch


def replica_cores(local_rank: int, threads: int, available: list[int]) -> list[int] | None:
    """The cores of the replica with this rank on its node: the rank's disjoint slice of the
    available cores; None when the node has too few for every replica to get its own."""
    start = local_rank * threads
    if threads < 1 or start + threads > len(available):
        return None
    return sorted(available)[start : start + threads]


def pin_replica(local_rank: int, threads: int) -> list[int] | None:
    """Set torch's thread count and, where Linux allows, this process's cores; the cores."""
    torch.set_num_threads(threads)
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = replica_cores(local_rank, threads, sorted(os.sched_getaffinity(0)))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    return cores
