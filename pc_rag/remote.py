"""The remote tier: module KV and the document registry in Redis (or Valkey), shared by replicas.

Everything read back from Redis was written by someone else: another replica, another version,
another tenant's process, or an attacker who can reach the server. So every value is checked
before it is used, and a bad one is skipped (and, for KV, deleted and re-encoded), never raised
into a request and never able to stop a replica from starting.

Layout, every key under ``pcrag:<engine fingerprint>:v<format>:`` (engines of different models,
dtypes, versions or payload formats share one Redis without ever reading each other's entries),
then the collection, so that a Redis ACL (``%RW~pcrag:*:tenant-a:*``) can confine a tenant's
replicas to its own collections:

- ``<collection>:kv:<digest>``: a module's record (format, key, fingerprint, bytes, chunk count,
  CRC-32); ``<collection>:kv:<digest>:<i>``: its safetensors payload in chunks of at most
  ``chunk_bytes`` (Redis refuses values over 512 MB). Chunks first, record last, in one
  MULTI/EXEC transaction: a reader never sees a record whose payload is not complete. Entries
  are content-addressed (the key hashes the engine, the collection, the tokens, their positions
  and what they were encoded behind) and immutable; ``ttl_s`` gives them an expiry.
- ``<collection>:meta``: what the collection is (documents and their system prompt, or a PML
  schema's source); ``<collection>:log``: the collection's document records, in order: ``add``
  (name, text, metadata) and ``delete`` (names). A replica replays the log from where it last
  read, in pages, so a deletion reaches every replica and a restarted one ends where the others
  did; ``<collection>:epoch`` tells a log begun again (Redis restarted empty) from the one a
  reader's position counts in.
- ``collections``: the set of collection names, for discovery (a replica confined to some
  collections is given their names instead: ``remote_collections=``).

Authentication: with an operator key (``remote_key=`` or ``PC_RAG_REMOTE_KEY``) every record
and log entry is stored as ``<HMAC-SHA256> <JSON>``, the MAC covering the Redis key it is stored
under, the JSON and, for KV, the whole payload; a value whose MAC does not verify under the
current key or one of the previous keys (rotation) is rejected. Without a key the MAC is ``-``
and only structure, checksums and shapes are checked (CRC is not authentication: anyone who can
write to Redis can then poison the tier; README says to set a key in production).

Redis down, slow or full never fails a request: every KV command runs under a timeout of a few
milliseconds (payload transfers, on their own connection, get room for their size too); an
error marks the tier down for ``retry_s`` seconds (logged once), during which it is skipped and
modules come from the local tiers or are encoded; afterwards it is tried again and hits resume.
Registry reads run in pages on a connection with their own, longer timeout: a page that fails
stops the read there (what was read is taken, nothing is skipped past); a registry key of the
wrong type is a rejected value, logged once, and never marks the KV tier down. Eviction is Redis' own (``maxmemory-policy allkeys-lru``): a record whose chunk was
evicted fails its check and is rebuilt.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import torch
from safetensors.torch import load as load_safetensors

from .documents import check_name
from .errors import PromptCacheError
from .kvcache import ModuleKV
from .store import FORMAT_VERSION, header_problem, serialize, split_key

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "valkey", "valkeys", "unix")
# the slowest transfer rate a healthy Redis is allowed for a payload chunk before it counts as down
BULK_BYTES_PER_S = 100e6
KEY_ENV = "PC_RAG_REMOTE_KEY"
PREVIOUS_KEYS_ENV = "PC_RAG_REMOTE_PREVIOUS_KEYS"  # comma-separated: keys still accepted while rotating
MAX_CHUNKS = 1 << 16  # a record asking for more is not one this library wrote
UNSIGNED = "-"


def connect(url: str, *, timeout_ms: float) -> Any:
    """A redis-py client for ``url`` (``redis://``, ``rediss://``, ``valkey://``, ``unix://``), with
    ``timeout_ms`` on connecting and on every command."""
    try:
        import redis
    except ImportError as err:  # pragma: no cover - the "distributed" extra
        raise PromptCacheError('remote_store needs the redis client: pip install "pc-rag[distributed]"') from err
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise PromptCacheError(f"remote_store must be a redis://, rediss://, valkey:// or unix:// URL, got {redact_url(url)!r}")
    # Valkey speaks the Redis protocol: its URL schemes are Redis' under another name
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    return redis.Redis.from_url(urlunsplit((scheme, *parts[1:])), socket_timeout=timeout_ms / 1000,
                                socket_connect_timeout=timeout_ms / 1000, retry_on_timeout=False)


# ---------------------------------------------------------------------------------------------
# Authentication
# ---------------------------------------------------------------------------------------------
class Signer:
    """HMAC-SHA256 under the operator's key: signs with the current key, accepts the current and
    the previous ones (key rotation). Without keys nothing is signed and everything verifies."""

    def __init__(self, key: str | bytes | None = None, previous: Iterable[str | bytes] = ()) -> None:
        keys = [k for k in [key, *previous] if k]
        self.keys = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]

    @classmethod
    def from_settings(cls, key: str | bytes | Sequence[str | bytes] | None) -> Signer:
        """``remote_key=``: a key, or a list (the first signs, all verify); None reads
        ``PC_RAG_REMOTE_KEY`` and ``PC_RAG_REMOTE_PREVIOUS_KEYS``."""
        if key is None:
            previous = [k.strip() for k in os.environ.get(PREVIOUS_KEYS_ENV, "").split(",") if k.strip()]
            return cls(os.environ.get(KEY_ENV) or None, previous)
        if isinstance(key, (str, bytes)):
            return cls(key)
        keys = list(key)
        if not keys or not all(isinstance(k, (str, bytes)) and k for k in keys):
            raise PromptCacheError("remote_key must be a non-empty str or bytes, or a list of them (the first signs)")
        return cls(keys[0], keys[1:])

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    @staticmethod
    def _mac(key: bytes, parts: Sequence[bytes]) -> str:
        mac = hmac.new(key, digestmod=hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))  # unambiguous framing of the parts
            mac.update(part)
        return mac.hexdigest()

    def sign(self, *parts: bytes) -> str:
        return self._mac(self.keys[0], parts) if self.keys else UNSIGNED

    def verify(self, mac: str, *parts: bytes) -> bool:
        if not self.keys:
            return True
        return any(hmac.compare_digest(mac, self._mac(key, parts)) for key in self.keys)


def _canonical(body: dict[str, Any]) -> str:
    # metadata that JSON cannot hold (dates, objects) is kept as its str()
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), sort_keys=True, default=str)


@dataclass
class LogRead:
    """What one read of a collection's log gave: its valid entries in order, and the index the
    next read starts at (past every entry read, skipped ones included; not past a page that
    could not be read)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    next: int = 0


class RemoteTier:
    """Module KV and document records in Redis (see module docstring)."""

    def __init__(self, url: str, fingerprint: str, *, key: str | bytes | Sequence[str | bytes] | None = None,
                 timeout_ms: float = 50.0, retry_s: float = 2.0, chunk_bytes: int = 64 << 20, ttl_s: float | None = None,
                 page_size: int = 2000, registry_timeout_ms: float = 2000.0, announce: bool = True) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise PromptCacheError(f"remote_ttl_s must be a number of seconds > 0 or None, got {ttl_s!r}")
        self.url = url
        self.fingerprint = fingerprint
        self.prefix = f"pcrag:{fingerprint}:v{FORMAT_VERSION}:"
        self.signer = Signer.from_settings(key)
        self.retry_s = retry_s
        self.chunk_bytes = chunk_bytes
        self.ttl_ms = int(ttl_s * 1000) if ttl_s is not None else None
        self.page_size = page_size
        # add written collections to the global set of names; off for a replica confined to its
        # collections (remote_collections=), whose ACL may allow nothing outside them
        self.announce = announce
        self.client = connect(url, timeout_ms=timeout_ms)
        # payload chunks travel on a second connection with room for their size: the small
        # commands before them (the record, EXISTS) already told a slow or absent Redis apart
        self.bulk = connect(url, timeout_ms=timeout_ms + 1000 * chunk_bytes / BULK_BYTES_PER_S)
        # registry pages: their own, longer timeout (a page of 2,000 records is not a 50 ms command)
        self.registry = connect(url, timeout_ms=registry_timeout_ms)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.errors = 0
        self.rejected = 0  # values read back and refused (malformed, unauthenticated, foreign)
        self._rejections: set[tuple[str, str]] = set()  # what was refused already: a bad record read at every sync is logged once

    # -- availability -------------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def ping(self) -> bool:
        """Whether Redis answers now (a round trip; marks the tier down when it does not)."""
        return bool(self._call("ping", lambda: self.client.ping(), False))

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            announce = self.available  # log when the tier goes down, not on every skipped call
            self._down_until = time.monotonic() + self.retry_s
        if announce:
            logger.warning("remote store %s unavailable (%s: %s); serving from local tiers, retrying in %.1f s",
                           redact_url(self.url), what, exc, self.retry_s)

    def _call(self, what: str, fn: Any, default: Any, *, refused_is_data: bool = False) -> Any:
        """``fn()`` unless the tier is down; a Redis or socket error marks it down and gives
        ``default``. With ``refused_is_data`` (registry reads), a command the server refuses (a
        key of the wrong type, written by someone else) is a rejected value instead: logged, and
        the tier stays up."""
        if not self.available:
            return default
        import redis

        try:
            return fn()
        except redis.ResponseError as exc:
            if not refused_is_data:
                self._failed(what, exc)
            else:
                self._reject(what, str(exc), once=True)
            return default
        except (redis.RedisError, OSError) as exc:
            self._failed(what, exc)
            return default

    def _reject(self, what: str, problem: str, *, once: bool = False) -> None:
        """Count and log a value that cannot be used; ``once``: a value read again at every sync
        (a collection's record, a key of the wrong type), counted and logged the first time only."""
        with self._lock:
            if once:
                if (what, problem) in self._rejections:
                    return
                if len(self._rejections) < 100_000:
                    self._rejections.add((what, problem))
            self.rejected += 1
        logger.warning("remote store: %s rejected: %s", what, problem)

    # -- signed values ------------------------------------------------------------------------
    def _signed(self, redis_key: str, body: dict[str, Any], payload: Iterable[bytes] = ()) -> str:
        text = _canonical(body)
        return f"{self.signer.sign(redis_key.encode(), text.encode(), *payload)} {text}"

    def _opened(self, redis_key: str, raw: Any, payload: Sequence[bytes] = ()) -> dict[str, Any]:
        """The JSON object of a signed value, or a PromptCacheError saying why it cannot be used."""
        if not isinstance(raw, (bytes, str)):
            raise PromptCacheError(f"not a string value ({type(raw).__name__})")
        text = raw.decode("utf-8", errors="strict") if isinstance(raw, bytes) else raw
        mac, _, body = text.partition(" ")
        try:
            value = json.loads(body)
        except ValueError as err:
            raise PromptCacheError(f"not JSON ({err})") from None
        if not isinstance(value, dict):
            raise PromptCacheError(f"a JSON {type(value).__name__}, not an object")
        if not self.signer.verify(mac, redis_key.encode(), body.encode(), *payload):
            raise PromptCacheError("not authenticated with the operator's key" if mac == UNSIGNED else "MAC does not verify")
        return value

    # -- module KV ----------------------------------------------------------------------------
    def _record_key(self, key: str) -> str:
        collection, digest = split_key(key)
        return f"{self.prefix}{collection}:kv:{digest}"

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
        record_key = self._record_key(key)
        record = {"format": FORMAT_VERSION, "key": key, "fingerprint": self.fingerprint, "bytes": len(blob),
                  "chunks": len(chunks), "crc32": zlib.crc32(blob), "created": time.time(), **info}
        value = self._signed(record_key, record, [blob])

        def run() -> bool:
            pipe = self.bulk.pipeline(transaction=True)
            for index, chunk in enumerate(chunks):
                pipe.set(f"{record_key}:{index}", chunk, px=self.ttl_ms)
            pipe.set(record_key, value, px=self.ttl_ms)
            pipe.execute()
            return True

        return bool(self._call("write", run, False))

    def load(self, key: str, device: torch.device | str = "cpu") -> ModuleKV | None:
        """The entry under ``key``, or None when absent, invalid (then deleted) or the tier is unavailable.

        The record must be this entry's (key, fingerprint, format), every chunk present, the
        payload of the recorded size and checksum and, with a key configured, its MAC must verify
        over the record and the payload before the payload is parsed. The tensors' shape, dtype
        and positions are the store's to check (:class:`pc_rag.store.KVShape`)."""
        record_key = self._record_key(key)
        raw = self._call("read", lambda: self.client.get(record_key), None)
        if raw is None:
            return None
        chunk_count = None
        try:
            text = raw.decode("utf-8", errors="strict")
            record = json.loads(text.partition(" ")[2])
            if not isinstance(record, dict):
                raise PromptCacheError("record is not a JSON object")
            problem = header_problem(record, key, self.fingerprint)
            if problem is not None:
                raise PromptCacheError(problem)
            chunk_count, size = record.get("chunks"), record.get("bytes")
            if not (isinstance(chunk_count, int) and 0 < chunk_count <= MAX_CHUNKS and isinstance(size, int) and size >= 0):
                chunk_count = None
                raise PromptCacheError("record with a malformed size or chunk count")
            names = [f"{record_key}:{i}" for i in range(chunk_count)]
            chunks = self._call("read", lambda: self.bulk.mget(names), None)
            if chunks is None:
                return None  # the tier went down between the two reads: a miss, not a bad entry
            if any(chunk is None for chunk in chunks):
                raise PromptCacheError("a chunk is missing (evicted?)")
            blob = b"".join(chunks)
            if len(blob) != size:
                raise PromptCacheError(f"truncated ({len(blob)} of {size} bytes)")
            if zlib.crc32(blob) != record.get("crc32"):
                raise PromptCacheError("checksum mismatch")
            self._opened(record_key, raw, [blob])  # the MAC, over record and payload
            tensors = load_safetensors(blob)
            return ModuleKV(tensors["kv"].to(device), tensors["positions"])
        except Exception as exc:  # noqa: BLE001 - anything unreadable is treated the same way
            problem = str(exc) if isinstance(exc, PromptCacheError) else f"unreadable ({type(exc).__name__}: {exc})"
        self._reject(f"entry {key[:48]}", f"{problem}; it will be re-encoded")
        self.discard(key, chunk_count)
        return None

    def discard(self, key: str, chunks: int | None = None) -> None:
        """Delete the entry: its record and its chunks (the record's count of them when it could be
        read, else found by pattern: the record may be the broken part)."""
        record_key = self._record_key(key)

        def run() -> None:
            if chunks is not None:
                names = [f"{record_key}:{i}" for i in range(chunks)]
            else:
                names = list(self.client.scan_iter(match=f"{record_key}:*", count=1000))
            self.client.delete(record_key, *names)

        self._call("delete", run, None)

    def delete_entries(self, keys: Sequence[str]) -> None:
        """Delete several entries, each with every chunk its record names (two round trips)."""
        if not keys:
            return
        record_keys = [self._record_key(key) for key in keys]

        def run() -> None:
            records = self.client.mget(record_keys)
            names: list[str] = list(record_keys)
            for record_key, raw in zip(record_keys, records):
                count = None
                try:
                    count = json.loads(raw.decode().partition(" ")[2]).get("chunks") if raw is not None else 0
                except (ValueError, AttributeError, UnicodeDecodeError):
                    pass
                if isinstance(count, int) and 0 <= count <= MAX_CHUNKS:
                    names.extend(f"{record_key}:{i}" for i in range(count))
                else:
                    names.extend(self.client.scan_iter(match=f"{record_key}:*", count=1000))
            self.bulk.delete(*names)

        self._call("delete", run, None)

    # -- registry -----------------------------------------------------------------------------
    def _meta_key(self, collection: str) -> str:
        return f"{self.prefix}{collection}:meta"

    def _log_key(self, collection: str) -> str:
        return f"{self.prefix}{collection}:log"

    def _epoch_key(self, collection: str) -> str:
        return f"{self.prefix}{collection}:epoch"

    def _publish(self, collection: str, meta: dict[str, Any] | None, entries: Sequence[dict[str, Any]]) -> bool:
        log_key = self._log_key(collection)

        def run() -> bool:
            pipe = self.client.pipeline(transaction=True)
            if self.announce:
                pipe.sadd(f"{self.prefix}collections", collection)
            if meta is not None:
                pipe.set(self._meta_key(collection), self._signed(self._meta_key(collection), meta))
            # the log's epoch: drawn by the first writer, so a log begun again (a Redis that came
            # back empty) is told apart from the one a reader's position counts in
            pipe.set(self._epoch_key(collection), secrets.token_hex(8), nx=True)
            if entries:
                pipe.rpush(log_key, *[self._signed(log_key, entry) for entry in entries])
            pipe.execute()
            return True

        return bool(self._call("write", run, False))

    def publish_documents(self, collection: str, system: str | None, records: Sequence[dict[str, Any]]) -> bool:
        """Append ``records`` (name, text, metadata) to document collection ``collection`` (one round trip)."""
        meta = {"collection": collection, "kind": "documents", "system": system}
        return self._publish(collection, meta, [{"op": "add", **record} for record in records])

    def publish_deletion(self, collection: str, names: Sequence[str]) -> bool:
        """Append a deletion of ``names`` to ``collection``'s log: every replica drops them at its next sync."""
        return self._publish(collection, None, [{"op": "delete", "names": list(names)}])

    def publish_schema(self, name: str, pml: str) -> bool:
        """Record PML schema ``name``'s source (a replica parses it and finds its modules' KV here)."""
        return self._publish(name, {"collection": name, "kind": "pml", "source": pml}, [])

    def collection_names(self) -> list[str] | None:
        """Every collection published under this fingerprint (None when Redis could not be read)."""
        raw = self._call("the set of collections", lambda: self.registry.smembers(f"{self.prefix}collections"), None,
                         refused_is_data=True)
        if raw is None:
            return None
        names = []
        for value in raw:
            try:
                names.append(check_name(value.decode(), "collection name"))
            except (PromptCacheError, UnicodeDecodeError):
                self._reject("collection name", f"{value[:64]!r} is not a valid name", once=True)
        return sorted(names)

    def collection_meta(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """What each of ``names`` is (``kind`` "documents" with ``system``, or "pml" with ``source``);
        collections whose record is absent or invalid are left out (invalid ones with a warning)."""
        if not names:
            return {}
        raw = self._call("collection records", lambda: self.registry.mget([self._meta_key(n) for n in names]), None, refused_is_data=True)
        out: dict[str, dict[str, Any]] = {}
        for name, value in zip(names, raw or []):
            if value is None:
                continue
            try:
                meta = self._opened(self._meta_key(name), value)
                if meta.get("collection") != name:
                    raise PromptCacheError(f"record of collection {meta.get('collection')!r}")
                if meta.get("kind") == "documents" and (meta.get("system") is None or isinstance(meta.get("system"), str)):
                    out[name] = meta
                elif meta.get("kind") == "pml" and isinstance(meta.get("source"), str):
                    out[name] = meta
                else:
                    raise PromptCacheError("neither a document collection nor a PML schema")
            except (PromptCacheError, UnicodeDecodeError) as err:
                self._reject(f"record of collection {name!r}", str(err), once=True)
        return out

    def log_lengths(self, names: Sequence[str]) -> dict[str, tuple[int, str | None]]:
        """How many entries each collection's log holds, and its epoch (one round trip; {} when unavailable)."""
        def run() -> dict[str, tuple[int, str | None]]:
            pipe = self.registry.pipeline(transaction=False)
            for name in names:
                pipe.llen(self._log_key(name))
                pipe.get(self._epoch_key(name))
            replies = pipe.execute(raise_on_error=False)
            out = {}
            for name, length, epoch in zip(names, replies[::2], replies[1::2]):
                if isinstance(length, int):  # a key of the wrong type: no log
                    out[name] = (length, epoch.decode(errors="replace") if isinstance(epoch, bytes) else None)
            return out

        return self._call("log lengths", run, {}, refused_is_data=True) if names else {}

    def read_log(self, collection: str, start: int = 0) -> LogRead:
        """The log entries of ``collection`` from index ``start`` on, read in pages of
        ``page_size``, each validated on its own: a malformed or unauthenticated entry is skipped
        with a warning, the others are taken. A page that cannot be read ends the read there."""
        log_key = self._log_key(collection)
        read = LogRead(next=start)
        while self.available:
            end = read.next + self.page_size - 1
            page = self._call(f"log of {collection!r} from entry {read.next}",
                              lambda: self.registry.lrange(log_key, read.next, end), None, refused_is_data=True)  # noqa: B023 - called at once
            if page is None:  # logged; the next sync goes on from here
                break
            for offset, raw in enumerate(page):
                try:
                    read.entries.append(self._log_entry(log_key, raw))
                except (PromptCacheError, UnicodeDecodeError) as err:
                    self._reject(f"log entry {read.next + offset} of {collection!r}", f"{err}; skipped")
            read.next += len(page)
            if len(page) < self.page_size:
                break
        return read

    def _log_entry(self, log_key: str, raw: Any) -> dict[str, Any]:
        """One log entry, validated (a PromptCacheError says why it cannot be taken)."""
        entry = self._opened(log_key, raw)
        op = entry.get("op")
        if op == "add":
            check_name(entry.get("name"), "document id")  # type: ignore[arg-type]
            text, meta = entry.get("text"), entry.get("metadata")
            if not isinstance(text, str) or not text:
                raise PromptCacheError("a document record without text")
            if meta is not None and not isinstance(meta, dict):
                raise PromptCacheError(f"metadata is a {type(meta).__name__}, not an object")
            return {"op": "add", "name": entry["name"], "text": text, "metadata": meta or {}}
        if op == "delete":
            names = entry.get("names")
            if not isinstance(names, list) or not names:
                raise PromptCacheError("a deletion without names")
            return {"op": "delete", "names": [check_name(n, "document id") for n in names]}
        raise PromptCacheError(f"unknown operation {op!r}")


def redact_url(url: str) -> str:
    """``url`` without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit((parts.scheme, netloc, *parts[2:]))
    return url
