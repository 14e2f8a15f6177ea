"""The disk tier of the prefix cache: full KV blocks in files under one directory, keyed by their
chained block hash, kept within a byte budget by LRU.

A block file (`<hash hex>.kvb`) holds a header (magic, format version, token count, payload
size), the block's token ids, its payload (kv/block_bytes.py) and a blake2b checksum of all
before it. A lookup reads the file whole and checks the checksum, the hash and the token ids (so
a hash collision never serves wrong KV), then keeps the payload staged until the runner loads
it; a file failing a check is deleted and is a miss, so its tokens are recomputed. Files are
written by a background thread, to a temporary name renamed into place: a crash leaves the
whole file or none, and a block waiting for its write is served from memory meanwhile.

Retention reaches the disk too: a block the pool evicts while a request's `cache.ttl` still
holds it keeps that time here, and the byte budget's LRU takes retained files only when no
other is left (the one whose retention ends first); the prefix-cache TTL does not drop them
before it. At most `max_retained_fraction` of the budget is retained at once. Retention lives
in memory only: after a restart the files are plain LRU.

`tier.json` records what the files are valid for (model, dtypes, block size, layer shapes,
format version); an engine with a different identity refuses the directory. Times come from
an injectable wall clock, so files keep their last use across restarts (as their mtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.kv.block_bytes import read_blocks, write_blocks
from tokenmill.kv.block_pool import BlockHash, EvictedBlock
from tokenmill.kv.quantized import KVCache

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
METADATA_FILE = "tier.json"
BLOCK_SUFFIX = ".kvb"
_MAGIC = b"TMKVBLK\0"
_HEADER = struct.Struct("<8sIIQ")  # magic, format version, number of tokens, payload bytes
_CHECKSUM = 32
_TOKEN = struct.Struct("<q")
_EXPIRY_SWEEP_S = 1.0  # the TTL sweep runs at most this often


@dataclass
class DiskTierStats:
    hits: int = 0  # blocks loaded into the pool from the tier
    writes: int = 0  # block files written
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0  # blocks dropped to stay within the byte budget
    expirations: int = 0  # blocks dropped by the prefix-cache TTL
    corrupt: int = 0  # files that failed a check, deleted and recomputed


@dataclass
class _Entry:
    size: int  # file bytes
    last_used: float
    pending: tuple[tuple[int, ...], bytes] | None = None  # token ids and payload, until written
    retained_until: float | None = None  # kept out of LRU and TTL eviction until then


def block_file_bytes(block_size: int, payload_bytes: int) -> int:
    return _HEADER.size + block_size * _TOKEN.size + payload_bytes + _CHECKSUM


def encode_block(token_ids: tuple[int, ...], payload: bytes) -> bytes:
    body = _HEADER.pack(_MAGIC, FORMAT_VERSION, len(token_ids), len(payload))
    body += struct.pack(f"<{len(token_ids)}q", *token_ids) + payload
    return body + hashlib.blake2b(body, digest_size=_CHECKSUM).digest()


def decode_block(data: bytes) -> tuple[tuple[int, ...], bytes] | None:
    """(token ids, payload), or None for a torn or corrupted file."""
    if len(data) < _HEADER.size + _CHECKSUM:
        return None
    body, checksum = data[:-_CHECKSUM], data[-_CHECKSUM:]
    if hashlib.blake2b(body, digest_size=_CHECKSUM).digest() != checksum:
        return None
    magic, version, num_tokens, payload_bytes = _HEADER.unpack_from(body)
    tokens_end = _HEADER.size + num_tokens * _TOKEN.size
    if magic != _MAGIC or version != FORMAT_VERSION or tokens_end + payload_bytes != len(body):
        return None
    token_ids = struct.unpack_from(f"<{num_tokens}q", body, _HEADER.size)
    return token_ids, body[tokens_end:]


class DiskTier:
    def __init__(
        self,
        directory: str | os.PathLike,
        budget_bytes: int,
        identity: dict[str, Any],
        block_size: int,
        payload_bytes: int,
        cache_ttl_s: float | None = None,
        clock: Callable[[], float] = time.time,
        max_retained_fraction: float = 0.5,
    ) -> None:
        """`identity`: what the files are valid for (model, dtypes, layer shapes...); a
        directory written under another identity is refused with a ValueError."""
        self.directory = Path(directory)
        self.block_size = block_size
        self.file_bytes = block_file_bytes(block_size, payload_bytes)
        if budget_bytes < self.file_bytes:
            raise ValueError(
                f"kv_offload_bytes ({budget_bytes}) is smaller than one block's file "
                f"({self.file_bytes} bytes)"
            )
        self.budget_bytes = budget_bytes
        self.max_retained_bytes = int(max_retained_fraction * budget_bytes)
        self.cache_ttl_s = cache_ttl_s
        self.clock = clock
        self.stats = DiskTierStats()
        self._identity = {"format_version": FORMAT_VERSION, "block_size": block_size, **identity}
        self._open_directory()
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, _Entry] = self._scan()
        # Verified (token ids, payload) of lookup hits, until loaded or unstaged.
        self._staged: dict[BlockHash, tuple[tuple[int, ...], bytes]] = {}
        self._next_sweep = 0.0
        self._bytes = sum(entry.size for entry in self._index.values())
        self._retained_bytes = 0
        self._make_room(0)
        self._queue: queue.Queue[BlockHash | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-tier", daemon=True)
        self._writer.start()

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def lookup(self, block_hash: BlockHash, token_ids: Iterable[int]) -> bool:
        """Whether the tier holds this block with exactly these token ids and an intact file;
        on a hit its payload is staged for `load`."""
        token_ids = tuple(token_ids)
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None:
                return False
            block = self._staged.get(block_hash) or entry.pending
        if block is None:
            block = self._read(block_hash)
            if block is None:
                return False
        if block[0] != token_ids:
            return False  # a hash collision: the file stays, for the block it was written for
        with self._lock:
            self._staged[block_hash] = block
        return True

    def unstage(self, keep: Iterable[BlockHash], max_blocks: int) -> None:
        """Once more than `max_blocks` payloads are staged, forget those not in `keep` (the
        requests that looked them up were not admitted, and may look them up again)."""
        if len(self._staged) <= max_blocks:
            return
        keep = set(keep)
        with self._lock:
            self._staged = {h: block for h, block in self._staged.items() if h in keep}

    def save(self, caches: list[KVCache], blocks: list[EvictedBlock]) -> None:
        """Copy these blocks' KV out of the caches (before their slots are reused) and queue
        their files; blocks already on disk only count as used."""
        with self._lock:
            new = [b for b in blocks if b.block_hash not in self._index]
            for block in blocks:
                if block.block_hash in self._index:
                    self._touch(block.block_hash, block.last_used)
                    self._retain(block.block_hash, block.retained_until)
        payloads = read_blocks(caches, [b.block_id for b in new])
        with self._lock:
            for block, payload in zip(new, payloads, strict=True):
                if block.block_hash in self._index or not self._make_room(self.file_bytes):
                    continue
                entry = _Entry(self.file_bytes, block.last_used, (block.token_ids, payload))
                self._index[block.block_hash] = entry
                self._bytes += entry.size
                self._retain(block.block_hash, block.retained_until)
                self._queue.put(block.block_hash)

    def load(self, caches: list[KVCache], loads: list[tuple[BlockHash, int]]) -> None:
        """Store staged payloads into pool blocks: (block hash, block id) pairs."""
        if not loads:
            return
        now = self.clock()
        with self._lock:
            payloads = [self._staged.pop(block_hash)[1] for block_hash, _ in loads]
            for block_hash, _ in loads:
                if block_hash in self._index:
                    self._touch(block_hash, now)
            self.stats.hits += len(loads)
        write_blocks(caches, [block_id for _, block_id in loads], payloads)

    def expire(self) -> None:
        """Drop blocks unused for longer than the TTL (checked at most once a second)."""
        now = self.clock()
        if self.cache_ttl_s is None or now < self._next_sweep:
            return
        self._next_sweep = now + _EXPIRY_SWEEP_S
        with self._lock:
            stale = [
                h
                for h, e in self._index.items()
                if e.last_used + self.cache_ttl_s <= now and not self._is_retained(e, now)
            ]
            for block_hash in stale:
                self._drop(block_hash)
            self.stats.expirations += len(stale)

    def flush(self) -> None:
        """Wait until every queued block is on disk."""
        self._queue.join()

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join()

    def _open_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(
                f"kv_offload_dir {str(self.directory)!r} is not writable: {exc}"
            ) from exc
        metadata = self.directory / METADATA_FILE
        if not metadata.exists():
            if any(self.directory.glob(f"*{BLOCK_SUFFIX}")):
                raise ValueError(
                    f"kv_offload_dir {str(self.directory)!r} holds block files but no "
                    f"{METADATA_FILE}: refusing to mix KV of unknown origin"
                )
            _write_atomically(metadata, json.dumps(self._identity, indent=1).encode())
            return
        try:
            found = json.loads(metadata.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read {metadata}: {exc}") from exc
        if found != self._identity:
            differ = sorted(
                key
                for key in {*found, *self._identity}
                if found.get(key) != self._identity.get(key)
            )
            details = "; ".join(
                f"{key}: directory {found.get(key)!r}, engine {self._identity.get(key)!r}"
                for key in differ
            )
            raise ValueError(
                f"kv_offload_dir {str(self.directory)!r} was written for another model or KV "
                f"layout ({details}); use another directory or empty this one"
            )

    def _scan(self) -> OrderedDict[BlockHash, _Entry]:
        """The index of the files already there, least recently used first; leftover
        temporary files of an interrupted write are deleted."""
        for leftover in self.directory.glob("*.tmp"):
            leftover.unlink(missing_ok=True)
        found = []
        for path in self.directory.glob(f"*{BLOCK_SUFFIX}"):
            try:
                block_hash = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime, block_hash, stat.st_size))
        found.sort()
        return OrderedDict((h, _Entry(size, mtime)) for mtime, h, size in found)

    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory / f"{block_hash.hex()}{BLOCK_SUFFIX}"

    def _read(self, block_hash: BlockHash) -> tuple[tuple[int, ...], bytes] | None:
        try:
            data = self._path(block_hash).read_bytes()
        except OSError:
            data = b""
        block = decode_block(data)
        with self._lock:
            self.stats.bytes_read += len(data)
            if block is None and block_hash in self._index:
                logger.warning("KV block file %s is damaged; recomputing it", block_hash.hex())
                self.stats.corrupt += 1
                self._drop(block_hash)
        return block

    def _touch(self, block_hash: BlockHash, now: float) -> None:
        entry = self._index[block_hash]
        entry.last_used = max(entry.last_used, now)
        self._index.move_to_end(block_hash)
        if entry.pending is None:
            with contextlib.suppress(OSError):
                os.utime(self._path(block_hash), (entry.last_used, entry.last_used))

    def _make_room(self, size: int) -> bool:
        """Evict blocks until `size` more bytes fit the budget: the least recently used first,
        a retained one only when nothing else is left."""
        while self._index and self._bytes + size > self.budget_bytes:
            self._drop(self._next_victim())
            self.stats.evictions += 1
        return self._bytes + size <= self.budget_bytes

    def _next_victim(self) -> BlockHash:
        now = self.clock()
        retained = []
        for block_hash, entry in self._index.items():
            if not self._is_retained(entry, now):
                return block_hash
            retained.append((entry.retained_until, block_hash))
        return min(retained)[1]

    def _retain(self, block_hash: BlockHash, until: float | None) -> None:
        """Keep the block out of LRU and TTL eviction until `until`, within the retained bound."""
        entry = self._index[block_hash]
        if until is None or until <= self.clock():
            return
        if entry.retained_until is None:
            if self._retained_bytes + entry.size > self.max_retained_bytes:
                return
            self._retained_bytes += entry.size
        entry.retained_until = max(entry.retained_until or until, until)

    def _is_retained(self, entry: _Entry, now: float) -> bool:
        """Whether a retention still runs; one that ran out stops counting against the bound."""
        if entry.retained_until is None:
            return False
        if entry.retained_until > now:
            return True
        entry.retained_until = None
        self._retained_bytes -= entry.size
        return False

    def _drop(self, block_hash: BlockHash) -> None:
        entry = self._index.pop(block_hash)
        self._bytes -= entry.size
        if entry.retained_until is not None:
            self._retained_bytes -= entry.size
        if entry.pending is None:
            self._path(block_hash).unlink(missing_ok=True)

    def _write_loop(self) -> None:
        while True:
            block_hash = self._queue.get()
            try:
                if block_hash is None:
                    return
                self._write(block_hash)
            except Exception:
                logger.exception("writing a KV block file failed")
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash) -> None:
        with self._lock:
            entry = self._index.get(block_hash)
            if entry is None or entry.pending is None:
                return  # evicted before its turn
            token_ids, payload = entry.pending
        data = encode_block(token_ids, payload)
        path = self._path(block_hash)
        try:
            _write_atomically(path, data)
            os.utime(path, (entry.last_used, entry.last_used))
        except OSError:
            logger.exception("cannot write KV block file %s", path)
            with self._lock:
                if self._index.get(block_hash) is entry:
                    self._drop(block_hash)
            path.unlink(missing_ok=True)
            return
        with self._lock:
            if self._index.get(block_hash) is entry:
                entry.pending = None
                self.stats.writes += 1
                self.stats.bytes_written += len(data)
            else:
                path.unlink(missing_ok=True)  # dropped while being written


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as file:
        file.write(data)
    os.replace(tmp, path)
