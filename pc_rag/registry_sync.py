"""The registry shared through the remote tier: this replica's additions and deletions published
to every other, and theirs taken in here.

:class:`RegistrySync` is the :class:`~pc_rag.registry.Registry`'s publisher: the registry tells
it what changed (under its own lock, so writes keep their order) and it queues each write for
Redis (:mod:`pc_rag.kv.replication` holds the records' format and logs). What Redis does not
take now is sent at the next sync. :meth:`RegistrySync.sync` reads the other replicas' log
entries and replays them through the registry (``publish=False``: never sent back). Records come
from a server others write to: each is validated on its own, a bad one skipped with a warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from .errors import PromptCacheError
from .prompt.documents import DEFAULT_SYSTEM, DocumentRecord
from .prompt.recurring import is_learned
from .registry import Registry

logger = logging.getLogger(__name__)


class RegistrySync:
    """Publishes a registry's changes to the remote tier and takes in other replicas' (module docstring)."""

    def __init__(self, registry: Registry, remote: Any, collections: Sequence[str] | None = None) -> None:
        self.registry = registry
        self.remote = remote  # pc_rag.kv.remote.RemoteTier
        self.collections = collections  # None: every collection of the shared registry
        self.seen: dict[str, int] = {}  # log entries of each remote collection read so far
        self._epoch: dict[str, str | None] = {}  # ... in the log of this epoch
        self._meta: dict[str, dict[str, Any]] = {}  # what each remote collection is (read once)
        self._unpublished: list[Callable[[], bool]] = []  # writes the remote tier has not taken yet, in order
        self._lock = threading.Lock()  # the queue of writes
        self._sync_lock = threading.Lock()  # one sync at a time

    # -- publishing (the registry calls these under its lock) ------------------------------------
    def schema_added(self, name: str, pml: str) -> None:
        self._publish(partial(self.remote.log.publish_schema, name, pml))

    def documents_added(self, collection: str, system: str, records: list[dict[str, Any]]) -> None:
        """``records``: ``{"name", "text", "metadata"}`` and, for a document encoded behind its
        neighbours, ``"context": {"form", "names"}``. Passages a replica learned stay its own."""
        if is_learned(collection):
            return
        self._publish(partial(self.remote.log.publish_documents, collection, system, records))

    def documents_deleted(self, collection: str, names: list[str]) -> None:
        if is_learned(collection):
            return
        self._publish(partial(self.remote.log.publish_deletion, collection, names))

    def _publish(self, write: Callable[[], bool]) -> None:
        """Queue one write (a call that says whether Redis took it) and send the queue in order (a
        later deletion never overtakes the addition it deletes)."""
        with self._lock:
            self._unpublished.append(write)
        self.flush_unpublished()

    def flush_unpublished(self) -> int:
        """Send the writes the remote tier has not taken yet; returns how many are left."""
        with self._lock:
            while self._unpublished and self._unpublished[0]():
                self._unpublished.pop(0)
            return len(self._unpublished)

    # -- taking in -------------------------------------------------------------------------------
    def sync(self, *, wait: bool = True) -> int:
        """Take in what other processes published since the last call: PML schemas, document
        additions (registered; their KV stays remote until a prompt needs it) and deletions, in
        log order. Returns how many documents and schemas changed here. ``wait=False`` returns 0
        at once when another thread is syncing."""
        if not self._sync_lock.acquire(blocking=wait):
            return 0
        try:
            if self._unpublished:
                self.flush_unpublished()
            names = list(self.collections) if self.collections is not None else self.remote.log.collection_names()
            if not names:
                return 0
            unknown = [n for n in names if n not in self._meta]
            if unknown:
                self._meta.update(self.remote.log.collection_meta(unknown))
            lengths = self.remote.log.log_lengths([n for n in names if self._meta.get(n, {}).get("kind") == "documents"])
            changed = sum(self._take_collection(name, lengths) for name in names if name in self._meta)
            if changed:
                logger.info("took in %d changes from the remote store", changed)
            return changed
        finally:
            self._sync_lock.release()

    def _take_collection(self, name: str, lengths: dict[str, tuple[int, str | None]]) -> int:
        meta = self._meta[name]
        if meta["kind"] == "pml":
            return self._take_schema(name, meta["source"])
        length, epoch = lengths.get(name, (0, None))
        if epoch != self._epoch.get(name):  # a log begun again: replay it from its start
            self._epoch[name] = epoch
            self.seen[name] = 0
        if length <= self.seen.get(name, 0):
            return 0
        read = self.remote.log.read_log(name, self.seen.get(name, 0))
        changed = self._replay(name, meta.get("system"), read.entries)
        self.seen[name] = read.next
        return changed

    def _take_schema(self, name: str, source: str) -> int:
        held = self.registry.snapshot().schemas.get(name)
        if held is None:
            try:
                self.registry.add_schema(source, progress=False, publish=False)
                return 1
            except PromptCacheError as err:
                logger.warning("remote schema %r not taken in: %s", name, err)
                self._meta[name] = {"kind": "skipped"}  # not tried again by this process
        elif held.source != source and self._meta.get(name, {}).get("warned") is None:
            logger.warning("remote schema %r differs from the one this process holds; keeping this process's", name)
            self._meta[name] = {**self._meta[name], "warned": True}
        return 0

    def _replay(self, collection: str, system: str | None, entries: list[dict[str, Any]]) -> int:
        """Apply a collection's log entries in order (runs of additions together)."""
        changed = 0
        run: list[dict[str, Any]] = []
        for entry in [*entries, None]:
            if entry is not None and entry["op"] == "add":
                run.append(entry)
                continue
            if run:
                changed += self._take_documents(collection, system, run)
                run = []
            if entry is not None:
                changed += len(self.registry.delete_documents(entry["names"], schema=collection, publish=False))
        return changed

    def _take_documents(self, collection: str, system: str | None, records: list[dict[str, Any]]) -> int:
        """Register remote document records (their KV stays remote); one that contradicts what is
        held here, or that cannot be a document here, is logged and skipped, the rest taken."""
        todo = self._new_records(collection, system, records)
        # one call per context form (the records say what their publisher encoded them behind)
        forms: dict[str | None, list[dict[str, Any]]] = {}
        for record in todo:
            forms.setdefault((record.get("context") or {}).get("form"), []).append(record)
        # plain documents first: the others may be encoded behind them
        batches = sorted(forms.values(), key=lambda batch: batch[0].get("context") is not None)
        taken = 0
        while batches:
            batch = batches.pop(0)
            form = (batch[0].get("context") or {}).get("form")
            try:
                self.registry.add_documents(
                    [DocumentRecord(r["name"], r["text"], r["metadata"]) for r in batch], schema=collection, system=system,
                    progress=False, publish=False, encode=False, context=form,
                    neighbours_of={r["name"]: r["context"]["names"] for r in batch if r.get("context")} if form else None,
                    context_texts={n: t for r in batch for n, t in (r.get("context") or {}).get("texts", {}).items()})
                taken += len(batch)
            except PromptCacheError as err:
                if len(batch) == 1 and form is not None:
                    # its context names documents this process lacks: taken as a plain document
                    # (another key: the publisher's entry, encoded behind them, is never read for it)
                    logger.warning("remote document %r of %r taken without its context: %s", batch[0]["name"], collection, err)
                    batches.append([{k: v for k, v in batch[0].items() if k != "context"}])
                elif len(batch) == 1:
                    logger.warning("remote document %r of %r not taken in: %s", batch[0]["name"], collection, err)
                else:  # find the bad ones by halving: the good ones are taken
                    batches.extend([batch[: len(batch) // 2], batch[len(batch) // 2 :]])
        return taken

    def _new_records(self, collection: str, system: str | None, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The records this replica does not hold yet; none when the collection cannot take them here."""
        spec = self.registry.spec
        if not spec.movable:
            logger.warning("remote collection %r: %d documents not taken in: documents are movable modules, and this model has %s",
                           collection, len(records), spec.pinned_reason)
            return []
        held = self.registry.snapshot().schemas.get(collection)
        if held is not None and (not held.layout.documents or held.system != (DEFAULT_SYSTEM if system is None else system)):
            logger.warning("remote collection %r: %d documents not taken in: this process holds %r as %s", collection, len(records),
                           collection, "a PML schema" if not held.layout.documents else "documents behind another system prompt")
            return []
        known = held.documents if held is not None else {}
        todo: dict[str, dict[str, Any]] = {}
        for record in records:
            name, text = record["name"], record["text"]
            have = known[name].text if name in known else todo[name]["text"] if name in todo else None
            if have is not None and have != text:
                logger.warning("remote document %r in %r holds another text than this process; skipped", name, collection)
            elif have is None:
                todo[name] = record
        return list(todo.values())
