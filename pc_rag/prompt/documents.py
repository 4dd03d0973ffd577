"""Documents as modules: input normalisation, names, prompts that import them, and references.

Two ways a prompt names stored documents:

- PML, from :func:`build_prompt`: ``<prompt schema="docs"><user><doc-1/>...question</user></prompt>``;
  the question is escaped, so user text can never become markup.
- A *module reference* inside plain text, from :func:`module_reference` (what LangChain's
  ``format_modules`` emits into an ordinary prompt template). A reference carries a tag: an
  HMAC of its collection and module name under a secret drawn when this process started. The
  engine only honours references whose tag verifies, so a user who types a reference into a
  question gets it read as text, never as an import, and a reference copied out of a trace
  opens that one module and nothing else (and only inside a request whose ``collections=``
  include its collection: see :func:`pc_rag.planner.plan`).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import PromptCacheError
from .plan import ModuleSpan
from .pml import PML, ROLES, escape

DEFAULT_SCHEMA = "docs"
DEFAULT_SYSTEM = "You are a helpful assistant. Answer the user's question using the documents they provide."
# what follows each document's text in its stored tokens: documents imported together read as
# separate paragraphs, as in LangChain's "\n\n".join(page_contents)
SEPARATOR = "\n\n"

MAX_COLLECTION_CHARS = 128
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_RESERVED = set(ROLES) | {"prompt", "schema", "module", "union", "param", "parameter"}

# honoured only with a tag made with this process's secret: see the module docstring
_SECRET = secrets.token_bytes(32)
_REFERENCE = re.compile(r"\[\[pc-rag-module ([0-9a-f]{32}) ([A-Za-z_][\w.\-]*)/([A-Za-z_][\w.\-]*)\]\]")


@dataclass(frozen=True)
class DocumentRecord:
    """A document as the engine holds it."""

    name: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def default_name(text: str) -> str:
    """A name derived from the text: the same text always gets the same module."""
    return "doc-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


_ID_CHARS = re.compile(r"[A-Za-z0-9_.\-]{1,200}", re.ASCII)


def module_name(doc_id: Any, text: str) -> str:
    """The module name of a document with id ``doc_id`` (a Document's ``id``, a node's ``node_id``,
    a vector store's key): the id itself when it is a valid module name, else an escaped form of it
    (``"1"`` -> ``"id.1"``, a UUID ``"3f2a-..."`` -> ``"id.3f2a-..."``, other characters hex-coded
    behind ``"idx."``), so every id names exactly one module and :func:`document_id` gives it back.
    Without an id (None or ""), a name derived from the text (:func:`default_name`)."""
    if doc_id is None or doc_id == "":
        return default_name(text)
    if not isinstance(doc_id, str):
        raise PromptCacheError(f"a document id must be a str, got {type(doc_id).__name__}")
    if _valid(doc_id) and not doc_id.startswith(("id.", "idx.")):
        return doc_id
    if _ID_CHARS.fullmatch(doc_id):
        return "id." + doc_id
    return "idx." + doc_id.encode("utf-8").hex()


def document_id(name: str) -> str:
    """The id :func:`module_name` made ``name`` from (a name it did not escape is its own id)."""
    if name.startswith("idx."):
        return bytes.fromhex(name[4:]).decode("utf-8")
    if name.startswith("id."):
        return name[3:]
    return name


def check_name(name: str, what: str = "document id") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PromptCacheError(f"invalid {what} {name!r}: use letters, digits, '_', '-', '.', starting with a letter or '_'")
    # a collection's (schema's) name is a folder's under kv_dir: past a filesystem's 255 bytes its
    # documents were accepted, then failed to encode (the OSError only in the server's log)
    if what in ("schema name", "collection name") and len(name) > MAX_COLLECTION_CHARS:
        raise PromptCacheError(f"invalid {what} {name[:40]!r}...: at most {MAX_COLLECTION_CHARS} characters, got {len(name)}")
    if name in _RESERVED:
        raise PromptCacheError(f"invalid {what} {name!r}: it is a reserved PML tag name")
    return name


def normalize(
    items: Sequence[Any] | Any,
    ids: Sequence[str] | None = None,
    metadatas: Sequence[Mapping[str, Any] | None] | None = None,
) -> list[DocumentRecord]:
    """Input documents (strings, LangChain ``Document``s, LlamaIndex nodes, or records it made
    before) as records: the one place every entry point reads them.

    A document's name is its id: ``ids`` (module names), else the Document's or node's own id,
    which may be anything (a vector store's UUID) and becomes a name through :func:`module_name`;
    without one, a name derived from its text (:func:`default_name`). ``metadatas`` update each
    document's own metadata. A name given twice with two different texts is an error."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise PromptCacheError(f"documents must be a list (of str, LangChain Documents or LlamaIndex nodes), got {type(items).__name__}")
    items = list(items)
    for arg, label in ((ids, "ids"), (metadatas, "metadatas")):
        if arg is not None and len(arg) != len(items):
            raise PromptCacheError(f"{label} has {len(arg)} entries for {len(items)} documents")
    out: list[DocumentRecord] = []
    texts: dict[str, str] = {}
    for index, item in enumerate(items):
        text, own_id, own_meta = _unpack(item, index)
        if not text:
            raise PromptCacheError(f"document {index} is empty")
        doc_id = ids[index] if ids is not None else own_id
        meta = dict(own_meta or {})
        if metadatas is not None and metadatas[index]:
            meta.update(metadatas[index])  # type: ignore[arg-type]
        name = check_name(doc_id) if doc_id is not None else default_name(text)
        if texts.setdefault(name, text) != text:
            raise PromptCacheError(f"document id {name!r} is given two different texts")
        out.append(DocumentRecord(name, text, meta))
    return out


def _unpack(item: Any, index: int) -> tuple[str, str | None, Mapping[str, Any] | None]:
    if isinstance(item, str):
        return item, None, None
    if isinstance(item, DocumentRecord):  # read once already (normalize's own output)
        return item.text, item.name, item.metadata
    if hasattr(item, "page_content"):  # langchain_core.documents.Document
        doc_id = getattr(item, "id", None)
        return item.page_content, module_name(doc_id, item.page_content) if doc_id else None, getattr(item, "metadata", None)
    if hasattr(item, "get_content") and hasattr(item, "node_id"):  # llama_index BaseNode
        # MetadataMode is a str enum: "none" is the node's text without its metadata header
        text = item.get_content(metadata_mode="none")
        return text, module_name(item.node_id, text) if item.node_id else None, getattr(item, "metadata", None)
    raise PromptCacheError(f"document {index}: expected str, LangChain Document or LlamaIndex node, got {type(item).__name__}")


def _valid(doc_id: Any) -> bool:
    """Whether an id works as a module name as it is."""
    return isinstance(doc_id, str) and _NAME.fullmatch(doc_id) is not None and doc_id not in _RESERVED


def build_prompt(question: str, modules: Sequence[str], *, schema: str = DEFAULT_SCHEMA, system: str | None = None,
                 reorder: bool = False, engine: Any = None) -> PML:
    """The PML prompt that imports ``modules`` (in that order) and asks ``question``.

    The question is escaped: whatever it contains is read as text. ``system`` adds a system turn
    as uncached text, for schemas without a system prompt of their own. ``reorder=True`` (with
    the ``engine`` that holds the documents) places each document after the neighbour it was
    encoded behind where the order allows (:meth:`pc_rag.PromptCache.reorder_documents`).
    """
    if not isinstance(question, str):
        raise PromptCacheError(f"question must be a str, got {type(question).__name__}")
    check_name(schema, "schema name")
    if reorder:
        if engine is None or not hasattr(engine, "reorder_documents"):
            raise PromptCacheError("reorder=True needs engine=, the PromptCache whose documents these are")
        modules = engine.reorder_documents(modules, schema=schema)
    refs = "".join(f"<{check_name(m, 'module name')}/>" for m in modules)
    system_turn = f"<system>{escape(system)}</system>" if system else ""
    return PML(f'<prompt schema="{schema}">{system_turn}<user>{refs}{escape(question)}</user></prompt>')


def _tag(schema: str, name: str) -> str:
    return hmac.new(_SECRET, f"{schema}/{name}".encode(), "sha256").hexdigest()[:32]


def module_reference(name: str, schema: str = DEFAULT_SCHEMA) -> str:
    """A reference to a stored module for use inside plain text (see the module docstring)."""
    schema, name = check_name(schema, "schema name"), check_name(name, "module name")
    return f"[[pc-rag-module {_tag(schema, name)} {schema}/{name}]]"


def is_reference(text: Any) -> bool:
    """Whether ``text`` is exactly one genuine reference: what adapters check before passing a
    reference found in untrusted metadata on."""
    m = _REFERENCE.fullmatch(text) if isinstance(text, str) else None
    return m is not None and hmac.compare_digest(m.group(1), _tag(m.group(2), m.group(3)))


def split_references(text: str) -> list[str | ModuleSpan]:
    """Split plain text at the genuine module references in it (spans of whole modules)."""
    out: list[str | ModuleSpan] = []
    cursor = 0
    for m in _REFERENCE.finditer(text):
        if not hmac.compare_digest(m.group(1), _tag(m.group(2), m.group(3))):
            continue  # a forged or foreign reference: text like any other
        if m.start() > cursor:
            out.append(text[cursor : m.start()])
        out.append(ModuleSpan(m.group(2), m.group(3)))
        cursor = m.end()
    if cursor < len(text):
        out.append(text[cursor:])
    return out
