"""What the engine knows by name: schemas, document collections and the drop-in text index.

Writers (:meth:`Registry.add_schema`, :meth:`Registry.add_documents`) hold one lock, encode what
they add through the :class:`~pc_rag.encoder.ModuleEncoder` first and publish after, so a prompt
never sees a module whose KV is not stored yet. Publishing replaces one immutable
:class:`Snapshot`; planners read the snapshot of the moment without any lock, and a plan keeps
the schemas it was planned against however the registry changes afterwards.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from types import MappingProxyType
from typing import Any

from tqdm.auto import tqdm

from . import documents as docs_mod
from .documents import DEFAULT_SCHEMA, DocumentRecord
from .dropin import IndexSnapshot, ModuleTextIndex
from .encoder import ModuleEncoder
from .errors import PromptCacheError
from .layout import SchemaLayout, add_document, document_layout, document_module, layout_schema, remove_documents, scaffold_paths
from .model import ModelSpec
from .pml import parse_schema

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JointPath:
    """Where a jointly encoded module (``encoding="scaffold"``) comes from: the path through the
    schema it was encoded on, and the index in that path of each of its tokens."""

    token_ids: tuple[int, ...] = field(repr=False)
    positions: tuple[int, ...] = field(repr=False)
    index: tuple[int, ...] = field(repr=False)

    @cached_property  # read on every fetch of the module: computed once
    def module_positions(self) -> list[int]:
        """The positions the module's tokens were encoded at (its KV is stored at them)."""
        return [self.positions[i] for i in self.index]


@dataclass(frozen=True)
class Schema:
    """A schema the engine holds: its layout and the store key of each module's KV. Immutable:
    adding documents publishes a new Schema."""

    name: str
    source: str
    layout: SchemaLayout = field(repr=False)
    keys: Mapping[str, str] = field(repr=False)
    # document collections (add_documents): the records by module name, and the system prompt
    documents: Mapping[str, DocumentRecord] = field(default_factory=dict, repr=False)
    system: str | None = None
    # encoding="scaffold": each module's path (modules of one path share its tuples)
    joint: Mapping[str, JointPath] = field(default_factory=dict, repr=False)

    @property
    def modules(self) -> list[str]:
        return self.layout.named_modules()

    @property
    def parameters(self) -> dict[str, dict[str, int]]:
        return {n: {p.name: p.length for p in self.layout.modules[n].params.values()} for n in self.modules}


@dataclass(frozen=True)
class _Joint:
    path: JointPath
    context_key: str


@dataclass(frozen=True)
class Snapshot:
    """The registry at one moment: what a plan is made against."""

    schemas: Mapping[str, Schema] = field(default_factory=dict)
    index: IndexSnapshot = field(default_factory=IndexSnapshot)


class Registry:
    """Schemas and documents behind one lock, published as immutable snapshots (module docstring)."""

    def __init__(self, spec: ModelSpec, encoder: ModuleEncoder, *, encoding: str, drop_in: bool, remote: Any = None,
                 remote_collections: Sequence[str] | None = None) -> None:
        self.spec = spec
        self.encoder = encoder
        self.encoding = encoding
        self.drop_in = drop_in
        self.index = ModuleTextIndex()
        self._schemas: dict[str, Schema] = {}
        self._snapshot = Snapshot(MappingProxyType({}), IndexSnapshot())
        self._lock = threading.RLock()
        self.remote = remote  # pc_rag.remote.RemoteTier: document records shared with other processes
        self.remote_collections = remote_collections  # None: every collection published there
        self._remote_seen: dict[str, int] = {}  # log entries of each remote collection read so far
        self._remote_epoch: dict[str, str | None] = {}  # ... in the log of this epoch
        self._remote_meta: dict[str, dict[str, Any]] = {}  # what each remote collection is (read once)
        self._unpublished: list[Callable[[], bool]] = []  # registry writes the remote tier has not taken yet, in order
        self._sync_lock = threading.Lock()
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()  # indexes to tell about deletions

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def _publish(self, schema: Schema) -> None:
        schemas = dict(self._schemas)
        schemas[schema.name] = schema
        self._schemas = schemas
        self._snapshot = Snapshot(MappingProxyType(schemas), self.index.snapshot())

    def _check_window(self, length: int, what: str) -> None:
        window = self.spec.context_window
        if window is not None and length > window:
            raise PromptCacheError(f"{what} needs {length} positions, more than the model's context window ({window})")

    # -----------------------------------------------------------------------------------------
    def add_schema(self, pml: str, *, progress: bool = True, publish: bool = True) -> Schema:
        """Parse a schema and encode all its modules (loaded from the store when present); with a
        remote tier, publish its source there (``publish=False`` when it comes from there)."""
        doc = parse_schema(pml)
        spec, encoder = self.spec, self.encoder
        with self._lock:
            existing = self._schemas.get(doc.name)
            if existing is not None and existing.source == pml:
                return existing
            if existing is not None and existing.layout.documents:
                raise PromptCacheError(f"schema {doc.name!r} is a document collection (add_documents); choose another name")
            layout = layout_schema(doc, spec.tokenize, spec.markers, spec.placeholder_id, spec.bos_ids)
            self._check_window(layout.length, f"schema {doc.name!r}")
            shared = self.encoding == "shared_prefix"
            prefix = layout.prefix if shared else None
            keys: dict[str, str] = {}
            if prefix is not None:
                info = layout.modules[prefix]
                keys[prefix] = encoder.key(doc.name, info.token_ids, info.positions, None)
            # shared_prefix computes the always-included text after the prefix at serve time (see
            # plan_prompt); cache="false" modules are always computed at serve time
            todo = [name for name, info in layout.modules.items()
                    if name != prefix and not (shared and info.anonymous) and info.cache and info.token_ids]
            joint = self._joint_paths(layout, compact=spec.movable) if self.encoding == "scaffold" else {}
            for name in todo:
                info = layout.modules[name]
                context_key = joint[name].context_key if name in joint else keys.get(prefix) if prefix else None
                keys[name] = encoder.key(doc.name, info.token_ids, info.positions, context_key)
            schema = Schema(doc.name, pml, layout, MappingProxyType(keys),
                            joint=MappingProxyType({n: p.path for n, p in joint.items() if n in keys}))
            missing = [n for n in todo if keys[n] not in encoder.store]
            if joint:
                for name in missing:
                    encoder.fetch(schema, name, keys[name])  # one forward pass per path encodes all its modules
            else:
                context = encoder.context(schema)
                for name in tqdm(todo, desc=f"encoding {doc.name}", unit="module", disable=not progress or not missing, leave=False):
                    info = layout.modules[name]
                    encoder.ensure(keys[name], info.token_ids, info.positions, context, {"schema": doc.name, "module": name, "tokens": len(info.token_ids)})
            self.index.remove_schema(doc.name)
            if self.drop_in:
                for name, info in layout.modules.items():
                    if info.text is not None and not info.anonymous and name in keys:
                        self.index.add(doc.name, name, info.text)
            self._publish(schema)
            if self.remote is not None and publish:
                self._publish_remote(partial(self.remote.log.publish_schema, doc.name, pml))
            logger.info("schema %r: %d modules, %d tokens, %d encoded", doc.name, len(schema.modules), layout.length, len(missing))
            return schema

    # -----------------------------------------------------------------------------------------
    def add_documents(
        self,
        texts: Sequence[Any],
        *,
        ids: Sequence[str] | None = None,
        metadatas: Sequence[dict[str, Any] | None] | None = None,
        schema: str = DEFAULT_SCHEMA,
        system: str | None = None,
        progress: bool = True,
        batch_tokens: int | None = None,
        publish: bool = True,
        encode: bool = True,
        replace_changed: bool = False,
    ) -> list[str]:
        """Store documents as movable modules of the document schema ``schema`` (see
        :meth:`pc_rag.PromptCache.add_documents`); returns their names. With a remote tier, the
        new documents' records are published to it (once per call) after their KV is stored
        there; ``publish=False`` when they come from it. ``encode=False`` registers them
        without looking for their KV: a prompt that imports one finds it in a tier or encodes
        it then (records taken in from the remote tier, whose KV is there).
        ``replace_changed=True``: a name that holds another text or metadata (a document edited
        under the same id) is deleted first (:meth:`delete_documents`) and added anew; without
        it, another text is an error (and other metadata is ignored)."""
        records = docs_mod.normalize(texts, ids, metadatas)
        spec = self.spec
        if not spec.movable:
            raise PromptCacheError(
                f"documents are movable modules, and this model has {spec.pinned_reason}, which cannot move; "
                "declare the documents in a PML schema (add_schema) instead"
            )
        docs_mod.check_name(schema, "schema name")
        with self._lock:
            target = self._document_schema(schema, system)
            if replace_changed:
                held = target.documents
                changed = [name for doc_id, text, meta in records
                           if (name := doc_id or docs_mod.default_name(text)) in held and (held[name].text, held[name].metadata) != (text, meta)]
                if changed:
                    self.delete_documents(changed, schema=schema, publish=publish)
                    target = self._document_schema(schema, system)
            layout = target.layout
            names: list[str] = []
            new: dict[str, tuple[str, dict[str, Any]]] = {}
            for doc_id, text, meta in records:  # validate everything before changing anything
                name = doc_id or docs_mod.default_name(text)
                known = target.documents.get(name)
                held = known.text if known is not None else new[name][0] if name in new else None
                if held is not None and held != text:
                    raise PromptCacheError(f"document id {name!r} already holds a different text in schema {schema!r}")
                if held is None:
                    new[name] = (text, meta)
                names.append(name)
            fresh: dict[str, tuple[str, list[int], dict[str, Any]]] = {}
            for (name, (text, meta)), text_ids in zip(new.items(), spec.tokenize_many([text for text, _ in new.values()])):
                self._check_window(layout.document_start + len(text_ids) + len(spec.separator_ids), f"document {name!r}")
                fresh[name] = (text, text_ids, meta)
            context_key = None
            if self.encoding != "isolated" and layout.prefix:  # scaffold: documents behind the prefix too
                context_key = f"{target.keys[layout.prefix]}+{layout.lead}"
            built = {name: document_module(layout, name, text, text_ids, spec.separator_ids) for name, (text, text_ids, _) in fresh.items()}
            keys = {name: self.encoder.key(schema, info.token_ids, info.positions, context_key) for name, info in built.items()}
            if batch_tokens is None:
                # on CPU a 2-core machine is compute-bound at batch 1 and padding only adds work
                batch_tokens = 512 if spec.device.type == "cpu" else 8192
            # encode first, publish after: a prompt served meanwhile never sees a document whose
            # KV is not stored yet (it would encode it a second time)
            if encode:
                self.encoder.encode_documents(target, [(keys[n], built[n]) for n in built], progress=progress, batch_tokens=batch_tokens)
            if built:
                # copy on write: plans made against the old Schema keep reading it unchanged
                new_layout = replace(layout, modules=dict(layout.modules), pieces=list(layout.pieces))
                documents = dict(target.documents)
                for name, info in built.items():
                    documents[name] = DocumentRecord(name, fresh[name][0], fresh[name][2])
                    add_document(new_layout, info)
                    if self.drop_in:
                        self.index.add(schema, name, info.text or "")
                target = replace(target, layout=new_layout, keys=MappingProxyType({**target.keys, **keys}), documents=MappingProxyType(documents))
                self._publish(target)
            if self.remote is not None and publish and fresh:
                self._publish_remote(partial(self.remote.log.publish_documents, schema, target.system, [
                    {"name": name, "text": text, "metadata": meta} for name, (text, _, meta) in fresh.items()]))
            logger.info("documents %r: %d added (%d new), %d held", schema, len(names), len(fresh), len(target.documents))
            return names

    # -----------------------------------------------------------------------------------------
    def delete_documents(self, names: Iterable[str], *, schema: str = DEFAULT_SCHEMA, publish: bool = True) -> list[str]:
        """Remove documents from collection ``schema``: from the registry and the drop-in index
        (no plan made from now on sees them), from every store tier (memory, disk and, when
        ``publish``, the remote tier), from the indexes watching this registry, and, when
        ``publish``, from every replica (a deletion appended to the collection's remote log).
        Returns the names removed (names the collection does not hold are not an error)."""
        wanted = [docs_mod.check_name(n) for n in ([names] if isinstance(names, str) else names)]
        with self._lock:
            target = self._schemas.get(schema)
            if target is None:
                return []
            if not target.layout.documents:
                raise PromptCacheError(f"schema {schema!r} is a PML schema, not a document collection: documents are deleted from collections")
            removed = [n for n in dict.fromkeys(wanted) if n in target.documents]
            if not removed:
                return []
            gone = set(removed)
            keys = {n: k for n, k in target.keys.items() if n not in gone}
            dead = sorted({target.keys[n] for n in removed} - set(keys.values()))  # two ids may share one text's entry
            documents = {n: r for n, r in target.documents.items() if n not in gone}
            self.index.remove(schema, removed)
            self._publish(replace(target, layout=remove_documents(target.layout, removed), keys=MappingProxyType(keys),
                                  documents=MappingProxyType(documents)))
            # a replica replaying a deletion leaves the shared entries to the replica that deleted
            # them (the log may add the same text again after it)
            self.encoder.store.delete(dead, remote=publish)
            if self.remote is not None and publish:
                self._publish_remote(partial(self.remote.log.publish_deletion, schema, removed))
            listeners = list(self._listeners)
        for listener in listeners:
            listener.forget(schema, removed)
        logger.info("documents %r: %d deleted, %d held", schema, len(removed), len(documents))
        return removed

    def watch(self, listener: Any) -> None:
        """Tell ``listener.forget(schema, names)`` about every deletion (held weakly)."""
        self._listeners.add(listener)

    # -- the remote registry ------------------------------------------------------------------
    def _publish_remote(self, write: Callable[[], bool]) -> None:
        """Queue one registry write (a call that says whether Redis took it) and send the queue in
        order (a later deletion never overtakes the addition it deletes); what Redis does not
        take now is sent at the next sync."""
        with self._lock:
            self._unpublished.append(write)
        self.flush_unpublished()

    def flush_unpublished(self) -> int:
        """Send the registry writes the remote tier has not taken yet; returns how many are left."""
        with self._lock:
            while self._unpublished and self._unpublished[0]():
                self._unpublished.pop(0)
            return len(self._unpublished)

    def sync_remote(self, *, wait: bool = True) -> int:
        """Take in what other processes published to the remote tier since the last call: PML
        schemas, document additions (registered; their KV stays remote until a prompt needs it)
        and deletions, in log order. Every record is validated on its own: a bad one is skipped
        with a warning and the rest is taken. Returns how many documents and schemas changed here.
        ``wait=False`` returns 0 at once when another thread is syncing."""
        if self.remote is None:
            return 0
        if not self._sync_lock.acquire(blocking=wait):
            return 0
        try:
            if self._unpublished:
                self.flush_unpublished()
            names = list(self.remote_collections) if self.remote_collections is not None else self.remote.log.collection_names()
            if not names:
                return 0
            unknown = [n for n in names if n not in self._remote_meta]
            if unknown:
                self._remote_meta.update(self.remote.log.collection_meta(unknown))
            lengths = self.remote.log.log_lengths([n for n in names if self._remote_meta.get(n, {}).get("kind") == "documents"])
            changed = 0
            for name in names:
                meta = self._remote_meta.get(name)
                if meta is None:
                    continue
                if meta["kind"] == "pml":
                    changed += self._take_schema(name, meta["source"])
                    continue
                length, epoch = lengths.get(name, (0, None))
                if epoch != self._remote_epoch.get(name):  # a log begun again: replay it from its start
                    self._remote_epoch[name] = epoch
                    self._remote_seen[name] = 0
                if length > self._remote_seen.get(name, 0):
                    read = self.remote.log.read_log(name, self._remote_seen.get(name, 0))
                    changed += self._replay(name, meta.get("system"), read.entries)
                    self._remote_seen[name] = read.next
            if changed:
                logger.info("took in %d changes from the remote store", changed)
            return changed
        finally:
            self._sync_lock.release()

    def _take_schema(self, name: str, source: str) -> int:
        held = self._schemas.get(name)
        if held is None:
            try:
                self.add_schema(source, progress=False, publish=False)
                return 1
            except PromptCacheError as err:
                logger.warning("remote schema %r not taken in: %s", name, err)
                self._remote_meta[name] = {"kind": "skipped"}  # not tried again by this process
        elif held.source != source and self._remote_meta.get(name, {}).get("warned") is None:
            logger.warning("remote schema %r differs from the one this process holds; keeping this process's", name)
            self._remote_meta[name] = {**self._remote_meta[name], "warned": True}
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
                changed += len(self.delete_documents(entry["names"], schema=collection, publish=False))
        return changed

    def _take_documents(self, collection: str, system: str | None, records: list[dict[str, Any]]) -> int:
        """Register remote document records (their KV stays remote); one that contradicts what is
        held here, or that cannot be a document here, is logged and skipped, the rest taken."""
        if not self.spec.movable:
            logger.warning("remote collection %r: %d documents not taken in: documents are movable modules, and this model has %s",
                           collection, len(records), self.spec.pinned_reason)
            return 0
        held = self._schemas.get(collection)
        if held is not None and (not held.layout.documents or held.system != (docs_mod.DEFAULT_SYSTEM if system is None else system)):
            logger.warning("remote collection %r: %d documents not taken in: this process holds %r as %s", collection, len(records),
                           collection, "a PML schema" if not held.layout.documents else "documents behind another system prompt")
            return 0
        known = held.documents if held is not None else {}
        todo: dict[str, dict[str, Any]] = {}
        for record in records:
            name, text = record["name"], record["text"]
            have = known[name].text if name in known else todo[name]["text"] if name in todo else None
            if have is not None and have != text:
                logger.warning("remote document %r in %r holds another text than this process; skipped", name, collection)
            elif have is None:
                todo[name] = record
        batches = [list(todo.values())]
        taken = 0
        while batches:
            batch = batches.pop()
            try:
                self.add_documents([r["text"] for r in batch], ids=[r["name"] for r in batch], metadatas=[r["metadata"] for r in batch],
                                   schema=collection, system=system, progress=False, publish=False, encode=False)
                taken += len(batch)
            except PromptCacheError as err:
                if len(batch) == 1:
                    logger.warning("remote document %r of %r not taken in: %s", batch[0]["name"], collection, err)
                else:  # find the bad ones by halving: the good ones are taken
                    batches.extend([batch[: len(batch) // 2], batch[len(batch) // 2 :]])
        return taken

    @staticmethod
    def _joint_paths(layout: SchemaLayout, compact: bool) -> dict[str, "_Joint"]:
        """Each module's path for joint encoding (see :func:`pc_rag.layout.scaffold_paths`).

        ``compact`` (modules can move): a path is encoded at consecutive positions, as a prompt
        that follows it is placed, so such a prompt reads exactly what full prefill computes even
        where a union's chosen member is shorter than its longest; else at schema positions."""
        joint: dict[str, _Joint] = {}
        for pieces, names in scaffold_paths(layout):
            ids: list[int] = []
            positions: list[int] = []
            where: dict[str, list[int]] = {}
            for piece in pieces:
                info = layout.modules[piece.owner]
                where.setdefault(piece.owner, []).extend(range(len(ids), len(ids) + piece.length))
                ids.extend(info.token_ids[piece.offset : piece.offset + piece.length])
                positions.extend(range(piece.start, piece.start + piece.length))
            path_ids, path_positions = tuple(ids), tuple(range(len(ids))) if compact else tuple(positions)
            context_key = "joint:" + hashlib.sha256(repr((path_ids, path_positions)).encode()).hexdigest()
            for name in names:
                if name in where:
                    joint[name] = _Joint(JointPath(path_ids, path_positions, tuple(where[name])), context_key)
        return joint

    def _document_schema(self, name: str, system: str | None) -> Schema:
        existing = self._schemas.get(name)
        if existing is not None:
            if not existing.layout.documents:
                raise PromptCacheError(f"schema {name!r} is a PML schema; put documents in a schema of their own")
            if system is not None and system != existing.system:
                raise PromptCacheError(
                    f"documents schema {name!r} was created with system prompt {existing.system!r}; "
                    "its documents are encoded behind it, so a different one needs another schema name"
                )
            return existing
        spec = self.spec
        system = docs_mod.DEFAULT_SYSTEM if system is None else system
        turn = spec.markers.starts["system"] + system + spec.markers.ends["system"] if system else ""
        # the user marker: a prompt's documents follow it, so they are encoded behind it too
        layout = document_layout(name, list(spec.bos_ids) + spec.tokenize(turn), spec.tokenize(spec.markers.starts["user"]))
        keys: dict[str, str] = {}
        if layout.prefix is not None:
            info = layout.modules[layout.prefix]
            keys[layout.prefix] = self.encoder.key(name, info.token_ids, info.positions, None)
            self.encoder.ensure(keys[layout.prefix], info.token_ids, info.positions, None, {"schema": name, "module": layout.prefix, "tokens": len(info.token_ids)})
            if self.drop_in and turn and not spec.bos_ids:
                # a chat prompt that opens with this very system turn reuses its KV too
                info.text, info.text_tokens = turn, len(info.token_ids)
                self.index.add(name, layout.prefix, turn)
        schema = Schema(name, f"<documents system={system!r}>", layout, MappingProxyType(keys), MappingProxyType({}), system)
        self._publish(schema)
        return schema
