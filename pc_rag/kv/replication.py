"""Registry replication: the document collections and PML schemas every replica shares, kept
in Redis next to the module KV (:mod:`pc_rag.kv.remote`), over the same :class:`~pc_rag.kv.redis_link.RedisLink`.

Layout, every key under the engine's prefix ``pcrag:<engine fingerprint>:v<format>:``, then the
collection (so that a Redis ACL ``%RW~pcrag:*:tenant-a:*`` can confine a tenant's replicas):

- ``<collection>:meta``: what the collection is (documents and their system prompt, or a PML
  schema's source); ``<collection>:log``: the collection's document records, in order: ``add``
  (name, text, metadata) and ``delete`` (names). A replica replays the log from where it last
  read, in pages, so a deletion reaches every replica and a restarted one ends where the others
  did; ``<collection>:epoch`` tells a log begun again (Redis restarted empty) from the one a
  reader's position counts in.
- ``<collection>:queue``: a hash of the documents some replica has queued for encoding and not
  encoded yet (name -> its text, ``status`` ``queued``/``in_progress``/``failed``, ``error``,
  ``at``): what every replica lists and reads as text while it waits, and what a DELETE on any
  replica removes (the replica holding it checks before it encodes, and after: its ``HDEL`` finding
  nothing means the document was deleted meanwhile). Entries older than ``QUEUE_STALE_S`` (a
  replica that died with them) are ignored.
- ``collections``: the set of collection names, for discovery (a replica confined to some
  collections is given their names instead: ``remote_collections=``).

Every record and log entry is signed and checked (:meth:`RedisLink.opened`) and validated field
by field; a bad one is skipped with a warning, never raised into a request or a replica's start.
Reads run in pages on the link's registry connection: a page that fails stops the read there
(what was read is taken, nothing is skipped past).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import PromptCacheError
from ..prompt.documents import check_name
from ..prompt.neighbours import CONTEXTS, MAX_NEIGHBOURS
from .redis_link import RedisLink

QUEUE_STATUSES = ("queued", "in_progress", "failed")
QUEUE_STALE_S = 3600.0


@dataclass
class LogRead:
    """What one read of a collection's log gave: its valid entries in order, and the index the
    next read starts at (past every entry read, skipped ones included; not past a page that
    could not be read)."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    next: int = 0


class RegistryLog:
    """The shared registry's records in Redis (see module docstring)."""

    def __init__(self, link: RedisLink, *, page_size: int = 2000, announce: bool = True) -> None:
        self.link = link
        self.page_size = page_size
        # add written collections to the global set of names; off for a replica confined to its
        # collections (remote_collections=), whose ACL may allow nothing outside them
        self.announce = announce

    def _meta_key(self, collection: str) -> str:
        return f"{self.link.prefix}{collection}:meta"

    def _log_key(self, collection: str) -> str:
        return f"{self.link.prefix}{collection}:log"

    def _epoch_key(self, collection: str) -> str:
        return f"{self.link.prefix}{collection}:epoch"

    def _publish(self, collection: str, meta: dict[str, Any] | None, entries: Sequence[dict[str, Any]]) -> bool:
        log_key = self._log_key(collection)

        def run() -> bool:
            pipe = self.link.client.pipeline(transaction=True)
            if self.announce:
                pipe.sadd(f"{self.link.prefix}collections", collection)
            if meta is not None:
                pipe.set(self._meta_key(collection), self.link.signed(self._meta_key(collection), meta))
            # the log's epoch: drawn by the first writer, so a log begun again (a Redis that came
            # back empty) is told apart from the one a reader's position counts in
            pipe.set(self._epoch_key(collection), secrets.token_hex(8), nx=True)
            if entries:
                pipe.rpush(log_key, *[self.link.signed(log_key, entry) for entry in entries])
            pipe.execute()
            return True

        return bool(self.link.call("write", run, False))

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

    # -- the shared queue of documents not encoded yet ------------------------------------------------
    def _queue_key(self, collection: str) -> str:
        return f"{self.link.prefix}{collection}:queue"

    def queue_put(self, collection: str, name: str, text: str, status: str, error: str | None = None, code: str | None = None) -> bool:
        """Record that document ``name`` of ``collection`` is queued, being encoded or failed, with its text."""
        key = self._queue_key(collection)
        body = {"name": name, "text": text, "status": status, "error": error, "code": code, "at": time.time()}
        return bool(self.link.call("queue write", lambda: self.link.client.hset(key, name, self.link.signed(f"{key}/{name}", body)), False))

    def queue_remove(self, collection: str, name: str) -> bool | None:
        """Remove ``name`` from the shared queue: whether it was there (None: Redis could not be asked)."""
        key = self._queue_key(collection)
        removed = self.link.call("queue write", lambda: self.link.client.hdel(key, name), None)
        return None if removed is None else bool(removed)

    def queue_holds(self, collection: str, name: str) -> bool | None:
        key = self._queue_key(collection)
        held = self.link.call("queue read", lambda: self.link.client.hexists(key, name), None)
        return None if held is None else bool(held)

    def queue_read(self, collection: str) -> dict[str, dict[str, Any]] | None:
        """The shared queue of ``collection`` (None when Redis could not be read), each entry validated
        on its own (a bad one is skipped with a warning; a stale one, left by a replica that died, is ignored)."""
        key = self._queue_key(collection)
        raw = self.link.call("queue read", lambda: self.link.registry.hgetall(key), None, refused_is_data=True)
        if raw is None:
            return None
        entries = ((field_name.decode(errors="replace"), value) for field_name, value in raw.items())
        return {name: entry for name, value in entries if (entry := self._queue_entry(collection, name, value)) is not None}

    def queue_entry(self, collection: str, name: str) -> dict[str, Any] | None:
        """One document's entry in the shared queue (one HGET), validated; None if absent, bad or stale."""
        key = self._queue_key(collection)
        value = self.link.call("queue read", lambda: self.link.client.hget(key, name), None, refused_is_data=True)
        return None if value is None else self._queue_entry(collection, name, value)

    def _queue_entry(self, collection: str, name: str, value: Any) -> dict[str, Any] | None:
        key = self._queue_key(collection)
        try:
            check_name(name, "document id")
            entry = self.link.opened(f"{key}/{name}", value)
            if entry.get("name") != name or entry.get("status") not in QUEUE_STATUSES or not isinstance(entry.get("text"), str) \
                    or not entry["text"] or not isinstance(entry.get("at"), (int, float)) \
                    or not all(entry.get(k) is None or isinstance(entry[k], str) for k in ("error", "code")):
                raise PromptCacheError("a malformed queue entry")
        except (PromptCacheError, UnicodeDecodeError) as err:
            self.link.reject(f"queue entry of {collection!r}", str(err), once=True)
            return None
        return entry if time.time() - entry["at"] < QUEUE_STALE_S else None

    def collection_names(self) -> list[str] | None:
        """Every collection published under this fingerprint (None when Redis could not be read)."""
        raw = self.link.call("the set of collections", lambda: self.link.registry.smembers(f"{self.link.prefix}collections"), None,
                         refused_is_data=True)
        if raw is None:
            return None
        names = []
        for value in raw:
            try:
                names.append(check_name(value.decode(), "collection name"))
            except (PromptCacheError, UnicodeDecodeError):
                self.link.reject("collection name", f"{value[:64]!r} is not a valid name", once=True)
        return sorted(names)

    def collection_meta(self, names: Sequence[str]) -> dict[str, dict[str, Any]]:
        """What each of ``names`` is (``kind`` "documents" with ``system``, or "pml" with ``source``);
        collections whose record is absent or invalid are left out (invalid ones with a warning)."""
        if not names:
            return {}
        raw = self.link.call("collection records", lambda: self.link.registry.mget([self._meta_key(n) for n in names]), None, refused_is_data=True)
        out: dict[str, dict[str, Any]] = {}
        for name, value in zip(names, raw or []):
            if value is None:
                continue
            try:
                meta = self.link.opened(self._meta_key(name), value)
                if meta.get("collection") != name:
                    raise PromptCacheError(f"record of collection {meta.get('collection')!r}")
                if meta.get("kind") == "documents" and (meta.get("system") is None or isinstance(meta.get("system"), str)):
                    out[name] = meta
                elif meta.get("kind") == "pml" and isinstance(meta.get("source"), str):
                    out[name] = meta
                else:
                    raise PromptCacheError("neither a document collection nor a PML schema")
            except (PromptCacheError, UnicodeDecodeError) as err:
                self.link.reject(f"record of collection {name!r}", str(err), once=True)
        return out

    def log_lengths(self, names: Sequence[str]) -> dict[str, tuple[int, str | None]]:
        """How many entries each collection's log holds, and its epoch (one round trip; {} when unavailable)."""
        def run() -> dict[str, tuple[int, str | None]]:
            pipe = self.link.registry.pipeline(transaction=False)
            for name in names:
                pipe.llen(self._log_key(name))
                pipe.get(self._epoch_key(name))
            replies = pipe.execute(raise_on_error=False)
            out = {}
            for name, length, epoch in zip(names, replies[::2], replies[1::2]):
                if isinstance(length, int):  # a key of the wrong type: no log
                    out[name] = (length, epoch.decode(errors="replace") if isinstance(epoch, bytes) else None)
            return out

        return self.link.call("log lengths", run, {}, refused_is_data=True) if names else {}

    def read_log(self, collection: str, start: int = 0) -> LogRead:
        """The log entries of ``collection`` from index ``start`` on, read in pages of
        ``page_size``, each validated on its own: a malformed or unauthenticated entry is skipped
        with a warning, the others are taken. A page that cannot be read ends the read there."""
        log_key = self._log_key(collection)
        read = LogRead(next=start)
        while self.link.available:
            end = read.next + self.page_size - 1
            page = self.link.call(f"log of {collection!r} from entry {read.next}",
                              lambda: self.link.registry.lrange(log_key, read.next, end), None, refused_is_data=True)  # noqa: B023 - called at once
            if page is None:  # logged; the next sync goes on from here
                break
            for offset, raw in enumerate(page):
                try:
                    read.entries.append(self._log_entry(log_key, raw))
                except (PromptCacheError, UnicodeDecodeError) as err:
                    self.link.reject(f"log entry {read.next + offset} of {collection!r}", f"{err}; skipped")
            read.next += len(page)
            if len(page) < self.page_size:
                break
        return read

    def _log_entry(self, log_key: str, raw: Any) -> dict[str, Any]:
        """One log entry, validated (a PromptCacheError says why it cannot be taken)."""
        entry = self.link.opened(log_key, raw)
        op = entry.get("op")
        if op == "add":
            check_name(entry.get("name"), "document id")  # type: ignore[arg-type]
            text, meta = entry.get("text"), entry.get("metadata")
            if not isinstance(text, str) or not text:
                raise PromptCacheError("a document record without text")
            if meta is not None and not isinstance(meta, dict):
                raise PromptCacheError(f"metadata is a {type(meta).__name__}, not an object")
            out = {"op": "add", "name": entry["name"], "text": text, "metadata": meta or {}}
            context = entry.get("context")
            if context is not None:  # what the publisher encoded it behind (pc_rag.prompt.neighbours)
                names = context.get("names") if isinstance(context, dict) else None
                if not isinstance(context, dict) or context.get("form") not in CONTEXTS or not isinstance(names, list) \
                        or not 0 < len(names) <= MAX_NEIGHBOURS:
                    raise PromptCacheError("a document record with a malformed context")
                out["context"] = {"form": context["form"], "names": [check_name(n, "neighbour id") for n in names]}
                texts = context.get("texts", {})  # neighbours held in the user's own store, not the collection
                if not isinstance(texts, dict) or not all(k in names and isinstance(v, str) and v for k, v in texts.items()):
                    raise PromptCacheError("a document record with a malformed context")
                if texts:
                    out["context"]["texts"] = dict(texts)
            return out
        if op == "delete":
            names = entry.get("names")
            if not isinstance(names, list) or not names:
                raise PromptCacheError("a deletion without names")
            return {"op": "delete", "names": [check_name(n, "document id") for n in names]}
        raise PromptCacheError(f"unknown operation {op!r}")
