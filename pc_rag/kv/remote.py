"""The remote tier of module KV: entries in Redis (or Valkey), shared by every replica.

Entries come back from a server others write to, so each is checked as every tier checks its
entries (:mod:`pc_rag.kv.records`: key, fingerprint, size, checksum; the store then checks the
tensors) and, with an operator key, its MAC over record and payload (:mod:`pc_rag.kv.redis_link`);
a bad one is logged, deleted and re-encoded, never served. Redis down, slow or full never fails
a request: the link's timeouts and down-marking send the store to its local tiers.

Layout, every key under ``pcrag:<engine fingerprint>:v<format>:`` (engines of different models,
dtypes, versions or payload formats share one Redis without ever reading each other's entries),
then the collection, so that a Redis ACL (``%RW~pcrag:*:tenant-a:*``) can confine a tenant's
replicas to its own collections: ``<collection>:kv:<digest>``: a module's record (the common
record plus its chunk count); ``<collection>:kv:<digest>:<i>``: its payload in chunks of at most
``chunk_bytes`` (Redis refuses values over 512 MB). Chunks first, record last, pipelined on one
connection (not MULTI/EXEC, which holds the server for everyone while it runs): Redis runs one
connection's commands in order, so a reader never sees a record whose payload was not written. Entries are
content-addressed (the key hashes the engine, the collection, the tokens, their positions and
what they were encoded behind) and immutable; ``ttl_s`` gives them an expiry. Eviction is
Redis' own (``maxmemory-policy allkeys-lru``): a record whose chunk was evicted fails its check
and is rebuilt.

The shared registry (document collections and schemas) lives beside the KV under the same prefix
and link: :mod:`pc_rag.kv.replication`, reached as :attr:`RemoteTier.log`.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from ..errors import PromptCacheError
from .records import FORMAT_VERSION, StoredKV, deserialize, new_record, payload_problem, record_problem, serialize, split_key
from .redis_link import RedisLink, redact_url
from .replication import LogRead, RegistryLog

__all__ = ["LogRead", "RegistryLog", "RemoteTier", "redact_url"]

MAX_CHUNKS = 1 << 16  # a record asking for more is not one this library wrote


class RemoteTier:
    """Module KV in Redis (see module docstring), and the shared registry beside it (:attr:`log`)."""

    def __init__(self, url: str, fingerprint: str, *, key: str | bytes | Sequence[str | bytes] | None = None,
                 timeout_ms: float = 50.0, retry_s: float = 2.0, chunk_bytes: int = 64 << 20, ttl_s: float | None = None,
                 page_size: int = 2000, registry_timeout_ms: float = 2000.0, announce: bool = True) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise PromptCacheError(f"remote_ttl_s must be a number of seconds > 0 or None, got {ttl_s!r}")
        self.link = RedisLink(url, fingerprint, f"pcrag:{fingerprint}:v{FORMAT_VERSION}:", key=key, timeout_ms=timeout_ms,
                              retry_s=retry_s, bulk_bytes=chunk_bytes, registry_timeout_ms=registry_timeout_ms)
        self.log = RegistryLog(self.link, page_size=page_size, announce=announce)
        self.chunk_bytes = chunk_bytes
        self.ttl_ms = int(ttl_s * 1000) if ttl_s is not None else None

    @property
    def url(self) -> str:
        return self.link.url

    @property
    def available(self) -> bool:
        return self.link.available

    @property
    def errors(self) -> int:
        """Commands that failed (the tier was skipped meanwhile)."""
        return self.link.errors

    @property
    def rejected(self) -> int:
        """Records, entries and log entries read back and refused."""
        return self.link.rejected

    def ping(self) -> bool:
        """Whether Redis answers now (a round trip; marks the tier down when it does not)."""
        return self.link.ping()

    def _record_key(self, key: str) -> str:
        collection, digest = split_key(key)
        return f"{self.link.prefix}{collection}:kv:{digest}"

    def __contains__(self, key: str) -> bool:
        return bool(self.link.call("exists", lambda: self.link.client.exists(self._record_key(key)), False))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` have a record (one round trip)."""
        def run() -> list[bool]:
            pipe = self.link.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._record_key(key))
            return [bool(found) for found in pipe.execute()]

        return self.link.call("exists", run, [False] * len(keys)) if keys else []

    def save(self, key: str, module: StoredKV, info: dict[str, Any]) -> bool:
        """Write the entry (chunks, then its record, in one transaction); False when the tier is unavailable."""
        blob = serialize(module)
        chunks = [blob[i : i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)] or [b""]
        record_key = self._record_key(key)
        record = new_record(key, self.link.fingerprint, blob, chunks=len(chunks), **info)
        value = self.link.signed(record_key, record, [blob])

        def run() -> bool:
            # no MULTI/EXEC: a transaction runs all its SETs at once, holding the server for every
            # other client while it does. One connection's commands run in order, so the record,
            # sent last, appears only after every chunk; a reader checks size and checksum anyway.
            pipe = self.link.bulk.pipeline(transaction=False)
            for index, chunk in enumerate(chunks):
                pipe.set(f"{record_key}:{index}", chunk, px=self.ttl_ms)
            pipe.set(record_key, value, px=self.ttl_ms)
            pipe.execute()
            return True

        return bool(self.link.call("write", run, False))

    def load(self, key: str, device: torch.device | str = "cpu", timing: dict[str, float] | None = None) -> StoredKV | None:
        """The entry under ``key``, or None when absent, invalid (then deleted) or the tier is unavailable.

        The record must be this entry's (key, fingerprint, format), every chunk present, the
        payload of the recorded size and checksum and, with a key configured, its MAC must verify
        over the record and the payload before the payload is parsed. The tensors' shape, dtype
        and positions are the store's to check (:class:`pc_rag.kv.records.KVShape`). ``timing``
        receives the load's ``latency_s`` (the record's round trip), ``transfer_s`` (the payload:
        read, checked, parsed) and ``bytes``."""
        record_key = self._record_key(key)
        started = time.perf_counter()
        raw = self.link.call("read", lambda: self.link.client.get(record_key), None)
        if raw is None:
            return None
        read_at = time.perf_counter()
        chunk_count = None
        try:
            record = json.loads(raw.decode("utf-8", errors="strict").partition(" ")[2])
            problem = record_problem(record, key, self.link.fingerprint)
            if problem is not None:
                raise PromptCacheError(problem)
            chunk_count = record.get("chunks")
            if not (isinstance(chunk_count, int) and 0 < chunk_count <= MAX_CHUNKS):
                chunk_count = None
                raise PromptCacheError("record with a malformed chunk count")
            names = [f"{record_key}:{i}" for i in range(chunk_count)]
            chunks = self.link.call("read", lambda: self.link.bulk.mget(names), None)
            if chunks is None:
                return None  # the tier went down between the two reads: a miss, not a bad entry
            if any(chunk is None for chunk in chunks):
                raise PromptCacheError("a chunk is missing (evicted?)")
            blob = b"".join(chunks)
            problem = payload_problem(record, len(blob), lambda: zlib.crc32(blob))
            if problem is not None:
                raise PromptCacheError(problem)
            self.link.opened(record_key, raw, [blob])  # the MAC, over record and payload
            module = deserialize(load_safetensors(blob)).to(device)
            if timing is not None:
                timing.update(latency_s=read_at - started, transfer_s=time.perf_counter() - read_at, bytes=len(blob))
            return module
        except Exception as exc:  # noqa: BLE001 - anything unreadable is treated the same way
            problem = str(exc) if isinstance(exc, PromptCacheError) else f"unreadable ({type(exc).__name__}: {exc})"
        self.link.reject(f"entry {key[:48]}", f"{problem}; it will be re-encoded")
        self.discard(key, chunk_count)
        return None

    def discard(self, key: str, chunks: int | None = None) -> None:
        """Delete the entry: its record and its chunks (the record's count of them when it could be
        read, else found by probing :meth:`_delete_chunks`)."""
        record_key = self._record_key(key)

        def run() -> None:
            if chunks is not None:
                self.link.client.delete(record_key, *[f"{record_key}:{i}" for i in range(chunks)])
            else:
                self.link.client.delete(record_key)
                self._delete_chunks(record_key)

        self.link.call("delete", run, None)

    def _delete_chunks(self, record_key: str) -> None:
        """Delete the chunks of an entry whose record is unreadable: chunk names are ``<record>:0``,
        ``:1``, ... written together, so they are deleted in pipelined batches until a batch finds
        its last one absent. Never a SCAN: that walks every key of the server (every tenant's)."""
        start, batch = 0, 16
        while start < MAX_CHUNKS:
            pipe = self.link.bulk.pipeline(transaction=False)
            for index in range(start, start + batch):
                pipe.delete(f"{record_key}:{index}")
            if not pipe.execute()[-1]:
                return
            start += batch

    def delete_entries(self, keys: Sequence[str]) -> None:
        """Delete several entries, each with every chunk its record names (two round trips; an
        unreadable record's chunks are probed for)."""
        if not keys:
            return
        record_keys = [self._record_key(key) for key in keys]

        def run() -> None:
            records = self.link.client.mget(record_keys)
            names: list[str] = list(record_keys)
            unknown: list[str] = []
            for record_key, raw in zip(record_keys, records):
                count = None
                try:
                    count = json.loads(raw.decode().partition(" ")[2]).get("chunks") if raw is not None else 0
                except (ValueError, AttributeError, UnicodeDecodeError):
                    pass
                if isinstance(count, int) and 0 <= count <= MAX_CHUNKS:
                    names.extend(f"{record_key}:{i}" for i in range(count))
                else:
                    unknown.append(record_key)
            self.link.bulk.delete(*names)
            for record_key in unknown:
                self._delete_chunks(record_key)

        self.link.call("delete", run, None)
