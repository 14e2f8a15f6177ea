"""The semantic cache on disk (`--semantic-cache-path`): one SQLite table of entries, written
through as the cache changes and read back at start, so a restarted server hits what the last
one cached.

A row holds what the cache keys on (scope, which carries the model and sampling settings, and
the normalised query), the query's embedding, the answer with the steps it grew by, and wall
clock times: when it expires and when it was last used (LRU order survives a restart).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.engine.outputs import CompletionOutput, RequestOutput
from tokenmill.gateway.semantic_cache import CachedAnswer
from tokenmill.gateway.transcript import steps_array
from tokenmill.request import RequestMetrics, SpecDecodeMetrics
from tokenmill.sampling.sampler import TokenLogprobs
from tokenmill.structured.tools import ToolCall

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    scope TEXT NOT NULL,
    query TEXT NOT NULL,
    vector BLOB NOT NULL,
    answer TEXT NOT NULL,
    expires_at REAL NOT NULL,
    used_at REAL NOT NULL
)
"""


@dataclass(frozen=True)
class StoredEntry:
    key: str
    scope: str
    query: str
    vector: np.ndarray
    answer: CachedAnswer
    expires_at: float  # wall clock (time.time) seconds


class CacheStore:
    def __init__(self, path: str | Path, wall_clock: Callable[[], float] = time.time) -> None:
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"--semantic-cache-path {path}: a directory, expected a file")
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(path, check_same_thread=False)  # used from one loop
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise ValueError(f"--semantic-cache-path {path}: not a cache file ({exc})") from exc
        self.wall_clock = wall_clock

    def load(self) -> list[StoredEntry]:
        """The live entries, least recently used first; expired ones are deleted."""
        with self._db:
            self._db.execute("DELETE FROM entries WHERE expires_at <= ?", (self.wall_clock(),))
        rows = self._db.execute(
            "SELECT key, scope, query, vector, answer, expires_at FROM entries ORDER BY used_at"
        )
        return [
            StoredEntry(
                key,
                scope,
                query,
                np.frombuffer(vector, dtype=np.float32).copy(),
                answer_from_json(json.loads(answer)),
                expires_at,
            )
            for key, scope, query, vector, answer, expires_at in rows
        ]

    def put(
        self,
        key: str,
        scope: str,
        query: str,
        vector: np.ndarray,
        answer: CachedAnswer,
        ttl_s: float,
    ) -> None:
        now = self.wall_clock()
        blob = np.asarray(vector, np.float32).tobytes()
        row = (key, scope, query, blob, json.dumps(answer_to_json(answer)), now + ttl_s, now)
        with self._db:
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?)", row)

    def touch(self, key: str) -> None:
        with self._db:
            self._db.execute(
                "UPDATE entries SET used_at = ? WHERE key = ?", (self.wall_clock(), key)
            )

    def delete(self, key: str) -> None:
        with self._db:
            self._db.execute("DELETE FROM entries WHERE key = ?", (key,))

    def close(self) -> None:
        self._db.close()


def answer_to_json(answer: CachedAnswer) -> dict[str, Any]:
    return {"model": answer.model, "steps": answer.steps.tolist(), "output": asdict(answer.output)}


def answer_from_json(data: dict[str, Any]) -> CachedAnswer:
    output = dict(data["output"])
    metrics = dict(output["metrics"])
    metrics["spec_decode"] = SpecDecodeMetrics(**metrics["spec_decode"])
    output["metrics"] = RequestMetrics(**metrics)
    output["outputs"] = [_completion(c) for c in output["outputs"]]
    if output["prompt_logprobs"] is not None:
        output["prompt_logprobs"] = [
            None if t is None else _logprobs(t) for t in output["prompt_logprobs"]
        ]
    return CachedAnswer(RequestOutput(**output), data["model"], steps_array(data["steps"]))


def _completion(data: dict[str, Any]) -> CompletionOutput:
    data = dict(data)
    if data["logprobs"] is not None:
        data["logprobs"] = [_logprobs(t) for t in data["logprobs"]]
    if data["tool_calls"] is not None:
        data["tool_calls"] = [ToolCall(**call) for call in data["tool_calls"]]
    return CompletionOutput(**data)


def _logprobs(data: dict[str, Any]) -> TokenLogprobs:
    return TokenLogprobs(
        data["token_id"], data["logprob"], data["rank"], [tuple(t) for t in data["top"]]
    )
