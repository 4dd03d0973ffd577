"""What the engine knows by name: schemas, document collections and the drop-in text index.

Writers (:meth:`Registry.add_schema`, :meth:`Registry.add_documents`) hold one lock, encode what
they add through the :class:`~pc_rag.prefill.encode.ModuleEncoder` first and publish after, so a prompt
never sees a module whose KV is not stored yet. Publishing replaces one immutable
:class:`Snapshot`; planners read the snapshot of the moment without any lock, and a plan keeps
the schemas it was planned against however the registry changes afterwards.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Protocol

from tqdm.auto import tqdm

from . import forks
from .errors import ContextWindowExceeded, PromptCacheError
from .model.spec import ModelSpec
from .prefill.encode import ModuleEncoder
from .prompt import documents as docs_mod
from .prompt.documents import DEFAULT_SCHEMA, DocumentRecord, check_name
from .prompt.dropin import IndexSnapshot, ModuleTextIndex
from .prompt.layout import SchemaLayout, add_document, document_layout, document_module, layout_schema, remove_documents, scaffold_paths
from .prompt.neighbours import DocumentContext, first_sentence
from .prompt.pml import parse_schema
from .registry_snapshot import JointPath, Schema, Snapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Joint:
    path: JointPath
    context_key: str


class Publisher(Protocol):
    """Who hears of every change the registry makes (:class:`pc_rag.registry_sync.RegistrySync`
    tells the other replicas); called under the registry's lock, so changes arrive in order."""

    def schema_added(self, name: str, pml: str) -> None: ...

    def documents_added(self, collection: str, system: str, records: list[dict[str, Any]]) -> None: ...

    def documents_deleted(self, collection: str, names: list[str]) -> None: ...


def _shared_record(record: DocumentRecord, context: DocumentContext | None, outside: Mapping[str, str]) -> dict[str, Any]:
    """A new document as the shared registry records it (:mod:`pc_rag.kv.replication`), with the
    texts of its neighbours that are ``outside`` the collection (a replica has no other source)."""
    entry: dict[str, Any] = {"name": record.name, "text": record.text, "metadata": record.metadata}
    if context is not None:
        entry["context"] = {"form": context.form, "names": list(context.names)}
        texts = {n: outside[n] for n in context.names if n in outside}
        if texts:
            entry["context"]["texts"] = texts
    return entry


def _context_key(base: str | None, context: DocumentContext | None) -> str | None:
    """What a document's store key says it was encoded behind: the prefix and lead (``base``),
    and its neighbour context's tokens (an entry is never served for another context)."""
    if context is None:
        return base
    return f"{base}+{context.form}:" + hashlib.sha256(repr(context.token_ids).encode()).hexdigest()


class Registry:
    """Schemas and documents behind one lock, published as immutable snapshots (module docstring)."""

    def __init__(self, spec: ModelSpec, encoder: ModuleEncoder, *, encoding: str, drop_in: bool) -> None:
        self.spec = spec
        self.encoder = encoder
        self.encoding = encoding
        self.drop_in = drop_in
        self.index = ModuleTextIndex()
        self._schemas: dict[str, Schema] = {}
        self._snapshot = Snapshot(MappingProxyType({}), IndexSnapshot())
        self._lock = threading.RLock()
        forks.renew_after_fork(self, "_lock")
        # who hears of every change (pc_rag.registry_sync.RegistrySync: other replicas), None: nobody
        self.publisher: Publisher | None = None
        self._listeners: weakref.WeakSet[Any] = weakref.WeakSet()  # indexes to tell about deletions

    def snapshot(self) -> Snapshot:
        return self._snapshot

    def _publish(self, schema: Schema) -> None:
        schemas = dict(self._schemas)
        schemas[schema.name] = schema
        self._schemas = schemas
        self._snapshot = Snapshot(MappingProxyType(schemas), self.index.snapshot())

    def _check_window(self, length: int, what: str, param: str | None = None) -> None:
        window = self.spec.context_window
        if window is not None and length > window:
            raise ContextWindowExceeded(f"{what} needs {length} positions, more than the model's context window ({window})", param=param)

    def check_documents_fit(self, records: Sequence[DocumentRecord], schema: str) -> None:
        """Refuse, before they are queued for encoding, documents that cannot fit the model's
        context window: their tokens, behind collection ``schema``'s system prompt when it exists
        (a new collection's is counted when the document is encoded)."""
        if self.spec.context_window is None:
            return
        target = self._schemas.get(schema)
        start = target.layout.document_start if target is not None and target.layout.documents else 0
        for record, text_ids in zip(records, self.spec.tokenize_many([r.text for r in records])):
            self._check_window(start + len(text_ids) + len(self.spec.separator_ids), f"document {record.name!r}", "documents")

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
            if publish and self.publisher is not None:
                self.publisher.schema_added(doc.name, pml)
            logger.info("schema %r: %d modules, %d tokens, %d encoded", doc.name, len(schema.modules), layout.length, len(missing))
            return schema

    # -----------------------------------------------------------------------------------------
    def add_documents(
        self,
        records: Sequence[DocumentRecord],
        *,
        schema: str = DEFAULT_SCHEMA,
        system: str | None = None,
        progress: bool = True,
        batch_tokens: int | None = None,
        publish: bool = True,
        encode: bool = True,
        replace_changed: bool = False,
        context: str | None = None,
        neighbours_of: Mapping[str, Sequence[str]] | None = None,
        context_texts: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Store ``records`` (:func:`pc_rag.prompt.documents.normalize` makes them from any input)
        as movable modules of the document collection ``schema`` (see
        :meth:`pc_rag.PromptCache.add_documents`); returns their names. ``publish=False`` when they
        come from the other replicas (:mod:`pc_rag.registry_sync`). ``encode=False`` registers them
        without looking for their KV: a prompt that imports one finds it in a tier or encodes it then.
        ``replace_changed=True``: a name that holds another text or metadata is deleted first and
        added anew; without it, another text is an error (and other metadata is ignored).

        ``context`` (``"neighbours"`` or ``"neighbour_sentences"``, :mod:`pc_rag.prompt.neighbours`) with
        ``neighbours_of`` (a new document's name -> the names it is encoded behind, the farthest
        first): each new document is encoded behind those documents' texts (or first sentences),
        found among this call's documents, the collection's and ``context_texts`` (name -> text,
        for documents held elsewhere: an encoding worker's batch)."""
        self._check_movable()
        check_name(schema, "schema name")
        with self._lock:
            target = self._document_schema(schema, system)
            if replace_changed:
                target = self._without_changed(target, records, system, publish)
            fresh = self._tokenised(target, self._new_documents(target, records))
            contexts = self._document_contexts(target, fresh, context, neighbours_of, context_texts) if context else {}
            built = self._document_modules(target, fresh, contexts)
            plain = self._document_modules(target, {n: fresh[n] for n in contexts}, {})
            # encode first, publish after: a prompt served meanwhile never sees a document whose
            # KV is not stored yet (it would encode it a second time)
            if encode:
                for modules, behind in ((built, contexts), (plain, {})):
                    self.encoder.encode_documents(target, list(modules.values()), progress=progress,
                                                  batch_tokens=batch_tokens or self._batch_tokens(), contexts=behind)
            outside = {n: context_texts[n] for c in contexts.values() for n in c.names
                       if context_texts and n in context_texts and n not in fresh and n not in target.documents}
            if built:
                target = self._with_documents(target, fresh, built, contexts, {n: key for n, (key, _) in plain.items()}, outside)
            if publish and fresh and self.publisher is not None:
                self.publisher.documents_added(schema, target.system,
                                               [_shared_record(r, contexts.get(r.name), target.outside) for r, _ in fresh.values()])
            logger.info("documents %r: %d added (%d new), %d held", schema, len(records), len(fresh), len(target.documents))
            return [record.name for record in records]

    def _check_movable(self) -> None:
        if not self.spec.movable:
            raise PromptCacheError(
                f"documents are movable modules, and this model has {self.spec.pinned_reason}, which cannot move; "
                "declare the documents in a PML schema (add_schema) instead"
            )

    def _without_changed(self, target: Schema, records: Sequence[DocumentRecord], system: str | None, publish: bool) -> Schema:
        """``target`` without the documents ``records`` give another text or metadata under their name."""
        held = target.documents
        changed = [r.name for r in records if r.name in held and (held[r.name].text, held[r.name].metadata) != (r.text, r.metadata)]
        if not changed:
            return target
        self.delete_documents(changed, schema=target.name, publish=publish)
        return self._document_schema(target.name, system)

    @staticmethod
    def _new_documents(target: Schema, records: Sequence[DocumentRecord]) -> list[DocumentRecord]:
        """The records ``target`` does not hold yet (each name once); an id that holds another text is an error."""
        new: dict[str, DocumentRecord] = {}
        for record in records:  # validate everything before changing anything
            known = target.documents.get(record.name)
            if known is not None and known.text != record.text:
                raise PromptCacheError(f"document id {record.name!r} already holds a different text in schema {target.name!r}")
            if known is None:
                new.setdefault(record.name, record)
        return list(new.values())

    def _tokenised(self, target: Schema, records: list[DocumentRecord]) -> dict[str, tuple[DocumentRecord, list[int]]]:
        """Each new record with its tokens, refused when it would not fit the model's context window."""
        spec = self.spec
        fresh = {}
        for record, text_ids in zip(records, spec.tokenize_many([r.text for r in records])):
            self._check_window(target.layout.document_start + len(text_ids) + len(spec.separator_ids), f"document {record.name!r}", "documents")
            fresh[record.name] = (record, text_ids)
        return fresh

    def _document_modules(self, target: Schema, fresh: Mapping[str, tuple[DocumentRecord, list[int]]],
                          contexts: Mapping[str, DocumentContext]) -> dict[str, tuple[str, Any]]:
        """Each new document's module (its tokens and positions behind its context) and its store key."""
        base = self._documents_key(target)
        built = {}
        for name, (record, text_ids) in fresh.items():
            context = contexts.get(name)
            info = document_module(target.layout, name, record.text, text_ids, self.spec.separator_ids,
                                   len(context.token_ids) if context is not None else 0)
            built[name] = (self.encoder.key(target.name, info.token_ids, info.positions, _context_key(base, context)), info)
        return built

    def _batch_tokens(self) -> int:
        # on CPU a 2-core machine is compute-bound at batch 1 and padding only adds work
        return 512 if self.spec.device.type == "cpu" else 8192

    def _with_documents(self, target: Schema, fresh: Mapping[str, tuple[DocumentRecord, list[int]]],
                        built: Mapping[str, tuple[str, Any]], contexts: Mapping[str, DocumentContext], plain: Mapping[str, str],
                        outside: Mapping[str, str]) -> Schema:
        """``target`` with the new documents, published (copy on write: plans made against the old
        Schema keep reading it unchanged)."""
        layout = replace(target.layout, modules=dict(target.layout.modules), pieces=list(target.layout.pieces))
        documents = dict(target.documents)
        for name, (_, info) in built.items():
            documents[name] = fresh[name][0]
            add_document(layout, info)
            if self.drop_in:
                self.index.add(target.name, name, info.text or "")
        keys = {name: key for name, (key, _) in built.items()}
        target = replace(target, layout=layout, keys=MappingProxyType({**target.keys, **keys}), documents=MappingProxyType(documents),
                         contexts=MappingProxyType({**target.contexts, **contexts}) if contexts else target.contexts,
                         plain=MappingProxyType({**target.plain, **plain}) if plain else target.plain,
                         # a neighbour held elsewhere that has become a document of the collection is read from it
                         outside=MappingProxyType({n: t for n, t in {**target.outside, **outside}.items() if n not in documents}))
        self._publish(target)
        return target

    def _documents_key(self, target: Schema) -> str | None:
        """What a collection's documents are encoded behind, as their keys say: the prefix and
        the lead (scaffold too), nothing for ``isolated``."""
        layout = target.layout
        if self.encoding == "isolated" or not layout.prefix:
            return None
        return f"{target.keys[layout.prefix]}+{layout.lead}"

    def _document_contexts(self, target: Schema, fresh: Mapping[str, tuple[DocumentRecord, list[int]]], form: str,
                           neighbours_of: Mapping[str, Sequence[str]] | None, extra: Mapping[str, str] | None) -> dict[str, DocumentContext]:
        """What each new document is encoded behind (see :meth:`add_documents`): its neighbours'
        tokens as a prompt places them (text, separator), the farthest dropped first where the
        context would not leave the document inside the model's context window."""
        if self.encoding == "isolated":
            raise PromptCacheError("context= needs documents encoded behind the system turn (encoding='shared_prefix'), not 'isolated'")
        layout, spec = target.layout, self.spec
        held = target.documents
        wanted: dict[str, list[str]] = {}
        for name, names in (neighbours_of or {}).items():
            if name not in fresh:
                continue  # a document held already keeps what it was encoded behind
            if isinstance(names, str) or not all(isinstance(n, str) for n in names):
                raise PromptCacheError(f"document {name!r}: its neighbours must be a list of document ids")
            chosen = list(dict.fromkeys(n for n in names if n != name))
            for other in chosen:
                if other not in fresh and other not in held and other not in (extra or {}):
                    raise PromptCacheError(f"document {name!r}: neighbour {other!r} is neither in collection {layout.name!r} "
                                           "nor among the documents added")
            if chosen:
                wanted[name] = chosen
        tokens = self._context_tokens(layout, held, {n for names in wanted.values() for n in names}, form, fresh, extra)
        window = spec.context_window
        out: dict[str, DocumentContext] = {}
        for name, names in wanted.items():
            own = len(fresh[name][1]) + len(spec.separator_ids)
            while names and window is not None and layout.document_start + sum(len(tokens[n]) for n in names) + own > window:
                names = names[1:]  # the farthest first: a document never leaves the window for its context
            if names:
                out[name] = DocumentContext(tuple(names), tuple(t for n in names for t in tokens[n]), form)
        return out

    def _context_tokens(self, layout: SchemaLayout, held: Mapping[str, DocumentRecord], names: Iterable[str], form: str,
                        fresh: Mapping[str, tuple[DocumentRecord, list[int]]] | None = None,
                        extra: Mapping[str, str] | None = None) -> dict[str, list[int]]:
        """Each of ``names`` as a context places it (text, separator): whole neighbours from their
        stored or fresh tokens, first sentences (and texts held elsewhere, ``extra``) tokenised in
        one batch."""
        spec, fresh, extra = self.spec, fresh or {}, extra or {}
        tokens: dict[str, list[int]] = {}
        todo: list[str] = []
        for name in sorted(set(names)):
            if form == "neighbours" and name in held:
                tokens[name] = list(layout.modules[name].token_ids)  # text and separator, as stored
            elif form == "neighbours" and name in fresh:
                tokens[name] = list(fresh[name][1]) + list(spec.separator_ids)
            else:
                todo.append(name)
        if todo:
            texts = [held[n].text if n in held else fresh[n][0].text if n in fresh else extra[n] for n in todo]
            if form == "neighbour_sentences":
                texts = [first_sentence(t) for t in texts]
            for name, ids in zip(todo, spec.tokenize_many(texts)):
                tokens[name] = list(ids) + list(spec.separator_ids)
        return tokens

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
            gone = set(removed) | {n for n in wanted if n in target.outside}  # a neighbour of the user's store, deleted there
            if not gone:
                return []
            keys = {n: k for n, k in target.keys.items() if n not in gone}
            documents = {n: r for n, r in target.documents.items() if n not in gone}
            # documents encoded behind a deleted one read its text: they lose it from their
            # context (their KV is encoded again, behind the neighbours left, when next needed)
            dependents = [n for n, c in target.contexts.items() if n not in gone and gone & set(c.names)]
            layout = remove_documents(target.layout, [*removed, *dependents])
            contexts = {n: c for n, c in target.contexts.items() if n not in gone and n not in dependents}
            plain = {n: k for n, k in target.plain.items() if n not in gone}
            outside = {n: t for n, t in target.outside.items() if n not in gone}
            self._recontext(target, layout, documents, outside, {n: [m for m in target.contexts[n].names if m not in gone] for n in dependents},
                            keys, contexts, plain)
            # two ids may share one text's entry, and a plain variant a plain document's
            held = {target.keys[n] for n in [*removed, *dependents]} | {target.plain[n] for n in removed if n in target.plain}
            dead = sorted(held - set(keys.values()) - set(plain.values()))
            self.index.remove(schema, removed)
            self._publish(replace(target, layout=layout, keys=MappingProxyType(keys), documents=MappingProxyType(documents),
                                  contexts=MappingProxyType(contexts), plain=MappingProxyType(plain), outside=MappingProxyType(outside)))
            # a replica replaying a deletion leaves the shared entries to the replica that deleted
            # them (the log may add the same text again after it)
            self.encoder.store.delete(dead, remote=publish)
            if publish and self.publisher is not None:
                self.publisher.documents_deleted(schema, [n for n in dict.fromkeys(wanted) if n in gone])
            listeners = list(self._listeners)
        for listener in listeners:
            listener.forget(schema, removed)
        logger.info("documents %r: %d deleted, %d held (%d lost a neighbour from their context)", schema, len(removed), len(documents),
                    len(dependents))
        return removed

    def _recontext(self, target: Schema, layout: SchemaLayout, documents: Mapping[str, DocumentRecord], outside: Mapping[str, str],
                   left: Mapping[str, list[str]], keys: dict[str, str], contexts: dict[str, DocumentContext], plain: dict[str, str]) -> None:
        """The documents ``left`` names (dependents of deleted ones, each with the neighbours it
        keeps, in the collection or ``outside`` it) added to ``layout`` anew, behind those
        neighbours: their store keys, contexts and plain variants updated in place. One that keeps
        no neighbour is a plain document (its plain variant is now its only one)."""
        base = self._documents_key(target)
        by_form: dict[str, set[str]] = {}  # the neighbours left, tokenised once per context form
        for name, names in left.items():
            by_form.setdefault(target.contexts[name].form, set()).update(names)
        tokens = {form: self._context_tokens(target.layout, documents, names, form, extra=outside) for form, names in by_form.items()}
        for name, names in left.items():
            old = target.layout.modules[name]
            context = None
            if names:
                form = target.contexts[name].form
                context = contexts[name] = DocumentContext(tuple(names), tuple(t for n in names for t in tokens[form][n]), form)
            else:
                plain.pop(name, None)
            info = document_module(layout, name, old.text or "", old.token_ids[: old.text_tokens], old.token_ids[old.text_tokens :],
                                   len(context.token_ids) if context is not None else 0)
            add_document(layout, info)
            keys[name] = self.encoder.key(target.name, info.token_ids, info.positions, _context_key(base, context))

    def watch(self, listener: Any) -> None:
        """Tell ``listener.forget(schema, names)`` about every deletion (held weakly)."""
        self._listeners.add(listener)

    @staticmethod
    def _joint_paths(layout: SchemaLayout, compact: bool) -> dict[str, "_Joint"]:
        """Each module's path for joint encoding (see :func:`pc_rag.prompt.layout.scaffold_paths`).

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
