"""The remote tier: module KV and the document registry in Redis (or Valkey), shared by replicas.

Layout, every key under ``pcrag:<engine fingerprint>:`` so engines of different models, dtypes
or versions share one Redis without ever reading each other's entries:

- ``kv:<module key>:<i>``: the entry's safetensors payload in chunks of at most ``chunk_bytes``
  (Redis refuses values over 512 MB); ``kv:<module key>``: the record (JSON: format, key,
  fingerprint, bytes, chunk count, CRC-32). The chunks are written first, the record last, in
  one MULTI/EXEC transaction, so a reader never sees a record whose payload is not complete.
  Entries are content-addressed (the module key hashes the engine, the tokens, their positions
  and what they were encoded behind) and immutable: a second writer writes the same bytes.
- ``schemas``: a hash, document-collection name -> its system prompt (JSON);
  ``docs:<schema>``: a list of document records (JSON: name, text, metadata), appended once
  per ``add_documents`` call; ``pml``: a hash, PML schema name -> its source.

On load the record must name the same key and fingerprint, every chunk must be there and the
payload must have the recorded size and checksum; anything else is logged, deleted and treated
as a miss, so the caller encodes the module again (and writes a good entry).

Redis down, slow or full never fails a request: every command runs under a timeout of a few
milliseconds (payload transfers, on their own connection, get room for their size too); an error marks the tier down for ``retry_s`` seconds (logged once), during which
it is skipped and modules come from the local tiers or are encoded; afterwards it is tried again
and hits resume. Eviction is Redis' own (``maxmemory-policy allkeys-lru``): a record whose
chunk was evicted fails the check above and is rebuilt.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch
from safetensors.torch import load as load_safetensors

from .errors import PromptCacheError
from .kvcache import ModuleKV
from .store import FORMAT_VERSION, header_problem, serialize

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")
# the slowest transfer rate a healthy Redis is allowed for a payload chunk before it counts as down
BULK_BYTES_PER_S = 100e6


def connect(url: str, *, timeout_ms: float) -> Any:
    """A redis-py client for ``url`` (``redis://``, ``rediss://``, ``valkey://``, ``unix://``), with
    ``timeout_ms`` on connecting and on every command."""
    try:
        import redis
    except ImportError as err:  # pragma: no cover - the "distributed" extra
        raise PromptCacheError('remote_store needs the redis client: pip install "pc-rag[distributed]"') from err
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise PromptCacheError(f"remote_store must be a redis://, rediss://, valkey:// or unix:// URL, got {url!r}")
    # Valkey speaks the Redis protocol: its URL schemes are Redis' under another name
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    return redis.Redis.from_url(urlunsplit((scheme, *parts[1:])), socket_timeout=timeout_ms / 1000,
                                socket_connect_timeout=timeout_ms / 1000, retry_on_timeout=False)


class RemoteTier:
    """Module KV and document records in Redis (see module docstring)."""

    def __init__(self, url: str, fingerprint: str, *, timeout_ms: float = 50.0, retry_s: float = 2.0,
                 chunk_bytes: int = 64 << 20) -> None:
        self.url = url
        self.fingerprint = fingerprint
        self.prefix = f"pcrag:{fingerprint}:"
        self.retry_s = retry_s
        self.chunk_bytes = chunk_bytes
        self.client = connect(url, timeout_ms=timeout_ms)
        # payload chunks travel on a second connection with room for their size: the small
        # commands before them (the record, EXISTS) already told a slow or absent Redis apart
        self.bulk = connect(url, timeout_ms=timeout_ms + 1000 * chunk_bytes / BULK_BYTES_PER_S)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.errors = 0

    # -- availability -------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            announce = self.available  # log when the tier goes down, not on every skipped call
            self._down_until = time.monotonic() + self.retry_s
        if announce:
            logger.warning("remote store %s unavailable (%s: %s); serving from local tiers, retrying in %.1f s",
                           _redact(self.url), what, exc, self.retry_s)

    def _call(self, what: str, fn: Any, default: Any) -> Any:
        """``fn()`` unless the tier is down; any Redis or socket error marks it down and gives ``default``."""
        if not self.available:
            return default
        import redis

        try:
            return fn()
        except (redis.RedisError, OSError) as exc:
            self._failed(what, exc)
            return default

    # -- module KV ----------------------------------------------------------------------------
    def _record_key(self, key: str) -> str:
        return f"{self.prefix}kv:{key}"

    def __contains__(self, key: str) -> bool:
        return bool(self._call("exists", lambda: self.client.exists(self._record_key(key)), False))

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Which of ``keys`` have a record (one round trip)."""
        def run() -> list[bool]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._record_key(key))
            return [bool(found) for found in pipe.execute()]

        return self._call("exists", run, [False] * len(keys)) if keys else []

    def save(self, key: str, module: ModuleKV, info: dict[str, Any]) -> bool:
        """Write the entry (chunks, then its record, in one transaction); False when the tier is unavailable."""
        blob = serialize(module)
        chunks = [blob[i : i + self.chunk_bytes] for i in range(0, len(blob), self.chunk_bytes)] or [b""]
        record = {"format": FORMAT_VERSION, "key": key, "fingerprint": self.fingerprint, "bytes": len(blob),
                  "chunks": len(chunks), "crc32": zlib.crc32(blob), "created": time.time(), **info}
        record_key = self._record_key(key)

        def run() -> bool:
            pipe = self.bulk.pipeline(transaction=True)
            for index, chunk in enumerate(chunks):
                pipe.set(f"{record_key}:{index}", chunk)
            pipe.set(record_key, json.dumps(record))
            pipe.execute()
            return True

        return bool(self._call("write", run, False))

    def load(self, key: str, device: torch.device | str = "cpu") -> ModuleKV | None:
        """The entry under ``key``, or None when absent, invalid (then deleted) or the tier is unavailable."""
        record_key = self._record_key(key)
        raw = self._call("read", lambda: self.client.get(record_key), None)
        if raw is None:
            return None
        problem = None
        try:
            record = json.loads(raw)
            problem = header_problem(record, key, self.fingerprint)
            if problem is None:
                names = [f"{record_key}:{i}" for i in range(int(record["chunks"]))]
                chunks = self._call("read", lambda: self.bulk.mget(names), None)
                if chunks is None:
                    return None  # the tier went down between the two reads: a miss, not a bad entry
                if any(chunk is None for chunk in chunks):
                    problem = "a chunk is missing (evicted?)"
                else:
                    blob = b"".join(chunks)
                    if len(blob) != record["bytes"]:
                        problem = f"truncated ({len(blob)} of {record['bytes']} bytes)"
                    elif zlib.crc32(blob) != record["crc32"]:
                        problem = "checksum mismatch"
                    else:
                        tensors = load_safetensors(blob)
                        # ModuleKV checks the shapes agree ([layers, 2, heads, tokens, dim] and one position per token)
                        return ModuleKV(tensors["kv"].to(device), tensors["positions"])
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is treated the same way
            problem = f"unreadable ({exc})"
        logger.warning("discarding remote entry %s: %s; it will be re-encoded", key[:16], problem)
        self.discard(key)
        return None

    def discard(self, key: str) -> None:
        """Delete the entry: its record and every chunk key (found by pattern: the record may be the broken part)."""
        record_key = self._record_key(key)

        def run() -> None:
            chunks = list(self.client.scan_iter(match=f"{record_key}:*", count=100))
            self.client.delete(record_key, *chunks)

        self._call("delete", run, None)

    # -- registry -----------------------------------------------------------------------------
    def publish_documents(self, schema: str, system: str | None, records: Sequence[dict[str, Any]]) -> bool:
        """Append ``records`` (name, text, metadata) to document collection ``schema`` (one round trip)."""
        def run() -> bool:
            pipe = self.client.pipeline(transaction=True)
            pipe.hset(f"{self.prefix}schemas", schema, json.dumps({"system": system}))
            if records:
                # metadata that JSON cannot hold (dates, objects) is kept as its str()
                pipe.rpush(f"{self.prefix}docs:{schema}", *[json.dumps(r, ensure_ascii=False, default=str) for r in records])
            pipe.execute()
            return True

        return bool(self._call("write", run, False))

    def publish_schema(self, name: str, pml: str) -> bool:
        """Record PML schema ``name``'s source (a replica parses it and finds its modules' KV here)."""
        return bool(self._call("write", lambda: self.client.hset(f"{self.prefix}pml", name, pml) is not None, False))

    def pml_schemas(self) -> dict[str, str]:
        """Every PML schema published under this fingerprint: name -> source."""
        return self._call("read", lambda: {k.decode(): v.decode() for k, v in self.client.hgetall(f"{self.prefix}pml").items()}, {})

    def document_collections(self, seen: dict[str, int] | None = None) -> dict[str, tuple[str | None, list[dict[str, Any]], int]]:
        """Document collections published under this fingerprint: name -> (system, records after
        the first ``seen[name]``, records in all), so a reader fetches each record once."""
        seen = seen or {}

        def run() -> dict[str, tuple[str | None, list[dict[str, Any]], int]]:
            schemas = self.client.hgetall(f"{self.prefix}schemas")
            out = {}
            for raw_name, value in schemas.items():
                name = raw_name.decode()
                records = [json.loads(r) for r in self.client.lrange(f"{self.prefix}docs:{name}", seen.get(name, 0), -1)]
                out[name] = (json.loads(value).get("system"), records, seen.get(name, 0) + len(records))
            return out

        return self._call("read", run, {})


def _redact(url: str) -> str:
    """``url`` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit((parts.scheme, netloc, *parts[2:]))
    return url
