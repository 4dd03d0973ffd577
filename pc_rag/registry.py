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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from tqdm.auto import tqdm

from . import documents as docs_mod
from .documents import DEFAULT_SCHEMA, DocumentRecord
from .dropin import IndexSnapshot, ModuleTextIndex
from .encoder import ModuleEncoder
from .errors import PromptCacheError
from .layout import SchemaLayout, add_document, document_layout, document_module, layout_schema, scaffold_paths
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

    def __init__(self, spec: ModelSpec, encoder: ModuleEncoder, *, encoding: str, drop_in: bool, remote: Any = None) -> None:
        self.spec = spec
        self.encoder = encoder
        self.encoding = encoding
        self.drop_in = drop_in
        self.index = ModuleTextIndex()
        self._schemas: dict[str, Schema] = {}
        self._snapshot = Snapshot(MappingProxyType({}), IndexSnapshot())
        self._lock = threading.RLock()
        self.remote = remote  # pc_rag.remote.RemoteTier: document records shared with other processes
        self._remote_seen: dict[str, int] = {}  # records of each remote collection read so far

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
                keys[prefix] = encoder.key(info.token_ids, info.positions, None)
            # shared_prefix computes the always-included text after the prefix at serve time (see
            # plan_prompt); cache="false" modules are always computed at serve time
            todo = [name for name, info in layout.modules.items()
                    if name != prefix and not (shared and info.anonymous) and info.cache and info.token_ids]
            joint = self._joint_paths(layout) if self.encoding == "scaffold" else {}
            for name in todo:
                info = layout.modules[name]
                context_key = joint[name].context_key if name in joint else keys.get(prefix) if prefix else None
                keys[name] = encoder.key(info.token_ids, info.positions, context_key)
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
                self.remote.publish_schema(doc.name, pml)
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
    ) -> list[str]:
        """Store documents as movable modules of the document schema ``schema`` (see
        :meth:`pc_rag.PromptCache.add_documents`); returns their names. With a remote tier, the
        new documents' records are published to it (once per call) after their KV is stored
        there; ``publish=False`` when they come from it."""
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
            layout = target.layout
            names: list[str] = []
            fresh: dict[str, tuple[str, list[int], dict[str, Any]]] = {}
            for doc_id, text, meta in records:  # validate everything before changing anything
                name = doc_id or docs_mod.default_name(text)
                known = target.documents.get(name)
                held = known.text if known is not None else fresh[name][0] if name in fresh else None
                if held is not None and held != text:
                    raise PromptCacheError(f"document id {name!r} already holds a different text in schema {schema!r}")
                if held is None:
                    text_ids = spec.tokenize(text)
                    self._check_window(layout.document_start + len(text_ids) + len(spec.separator_ids), f"document {name!r}")
                    fresh[name] = (text, text_ids, meta)
                names.append(name)
            context_key = None
            if self.encoding != "isolated" and layout.prefix:  # scaffold: documents behind the prefix too
                context_key = f"{target.keys[layout.prefix]}+{layout.lead}"
            built = {name: document_module(layout, name, text, text_ids, spec.separator_ids) for name, (text, text_ids, _) in fresh.items()}
            keys = {name: self.encoder.key(info.token_ids, info.positions, context_key) for name, info in built.items()}
            if batch_tokens is None:
                # on CPU a 2-core machine is compute-bound at batch 1 and padding only adds work
                batch_tokens = 512 if spec.device.type == "cpu" else 8192
            # encode first, publish after: a prompt served meanwhile never sees a document whose
            # KV is not stored yet (it would encode it a second time)
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
                self.remote.publish_documents(schema, target.system, [
                    {"name": name, "text": text, "metadata": meta} for name, (text, _, meta) in fresh.items()])
            logger.info("documents %r: %d added (%d new), %d held", schema, len(names), len(fresh), len(target.documents))
            return names

    def sync_remote(self) -> int:
        """Add the PML schemas and document records published to the remote tier since the last
        call (their KV is found there, not encoded); returns how many were new here. A record that contradicts one
        held here (same name, other text) is logged and skipped."""
        if self.remote is None:
            return 0
        added = 0
        with self._lock:
            seen = dict(self._remote_seen)
        collections = self.remote.document_collections(seen)  # Redis I/O outside the writers' lock
        for name, source in self.remote.pml_schemas().items():
            held = self._schemas.get(name)
            if held is None:
                try:
                    self.add_schema(source, progress=False, publish=False)
                    added += 1
                except PromptCacheError as err:
                    logger.warning("remote schema %r not taken in: %s", name, err)
            elif held.source != source:
                logger.warning("remote schema %r differs from the one this process holds; keeping this process's", name)
        for schema, (system, records, read) in collections.items():
            held = self._schemas.get(schema)
            known = held.documents if held is not None else {}
            todo: dict[str, dict[str, Any]] = {}
            for record in records:
                name, text = record.get("name"), record.get("text")
                if not isinstance(name, str) or not isinstance(text, str):
                    logger.warning("remote document record in %r is malformed; skipped", schema)
                elif name in known and known[name].text != text:
                    logger.warning("remote document %r in %r holds another text than this process; skipped", name, schema)
                elif name not in known:
                    todo.setdefault(name, record)
            try:
                if todo:
                    self.add_documents([r["text"] for r in todo.values()], ids=list(todo), metadatas=[r.get("metadata") for r in todo.values()],
                                       schema=schema, system=system, progress=False, publish=False)
                    added += len(todo)
            except PromptCacheError as err:
                logger.warning("remote documents of %r not taken in: %s", schema, err)
            with self._lock:
                self._remote_seen[schema] = max(read, self._remote_seen.get(schema, 0))
        if added:
            logger.info("took in %d documents from the remote store", added)
        return added

    @staticmethod
    def _joint_paths(layout: SchemaLayout) -> dict[str, "_Joint"]:
        """Each module's path for joint encoding (see :func:`pc_rag.layout.scaffold_paths`)."""
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
            path_ids, path_positions = tuple(ids), tuple(positions)
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
            keys[layout.prefix] = self.encoder.key(info.token_ids, info.positions, None)
            self.encoder.ensure(keys[layout.prefix], info.token_ids, info.positions, None, {"schema": name, "module": layout.prefix, "tokens": len(info.token_ids)})
            if self.drop_in and turn and not spec.bos_ids:
                # a chat prompt that opens with this very system turn reuses its KV too
                info.text, info.text_tokens = turn, len(info.token_ids)
                self.index.add(name, layout.prefix, turn)
        schema = Schema(name, f"<documents system={system!r}>", layout, MappingProxyType(keys), MappingProxyType({}), system)
        self._publish(schema)
        return schema
