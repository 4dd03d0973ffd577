"""Positions: the layout of a schema (paper §3.3).

No torch here: this module turns parsed PML plus a tokenizer function into token ids and
schema positions; :mod:`pc_rag.prompt.plan` places a prompt's tokens over them.

Schema layout. Every token of a schema gets a schema position: text and parameter slots advance
a cursor; the members of a ``<union>`` all start at the union's start and the union is as long as
its longest member. Each module owns the tokens written directly in it (its text and parameter
placeholders); a nested module owns its own. Always-included text outside modules forms
*anonymous* modules, one per maximal run, named ``#0``, ``#1``, ...
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ..errors import PromptCacheError
from .pml import ModuleNode, ParamNode, PromptRole, RoleMark, RoleNode, SchemaDoc, SchemaNode, TextNode, UnionNode

logger = logging.getLogger(__name__)

# how module KV is encoded (see pc_rag.engine): here, where the CLI reads it without loading torch
Encoding = Literal["isolated", "shared_prefix", "scaffold"]
ENCODINGS: tuple[str, ...] = ("isolated", "shared_prefix", "scaffold")

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class ChatMarkers:
    """Text that the model's chat template puts around each role, and its generation prompt."""

    starts: dict[str, str]
    ends: dict[str, str]
    generation: str
    no_system: str = ""  # the opening of a conversation without a system prompt (a bare <system/>)

    def wrap(self, role: str) -> tuple[str, str]:
        return self.starts[role], self.ends[role]

    def text(self, node: RoleNode | PromptRole | RoleMark) -> tuple[str, str]:
        """The text before and after a role tag's content."""
        if isinstance(node, RoleMark):
            return (self.starts[node.role], "") if node.edge == "open" else ("", self.ends[node.role])
        if node.bare and node.role == "system":
            return self.no_system, ""
        return self.wrap(node.role)


class Turns:
    """The chat turn open at each point of a schema or prompt read in order. Turns do not nest;
    a role tag may be an element or a loose edge (:class:`pc_rag.prompt.pml.RoleMark`), so a schema may
    leave a turn open for its prompts to close, as the reference implementation's files do."""

    def __init__(self, role: str | None = None, line: int = 0, column: int = 0) -> None:
        self.role, self.line, self.column = role, line, column

    def copy(self) -> "Turns":
        return Turns(self.role, self.line, self.column)

    def open(self, role: str, line: int, column: int) -> None:
        if self.role is not None:
            where = f"at line {self.line}, column {self.column}" if self.line else "by the schema"
            raise PromptCacheError(f"<{role}> opens a turn inside the <{self.role}> turn opened {where}: close it first", line=line, column=column)
        self.role, self.line, self.column = role, line, column

    def close(self, role: str, line: int, column: int) -> None:
        if self.role != role:
            found = f"the open turn is <{self.role}>" if self.role else "no turn is open"
            raise PromptCacheError(f"</{role}> closes no <{role}> turn: {found}", line=line, column=column)
        self.role = None

    def enter(self, node: RoleNode | PromptRole | RoleMark) -> None:
        """Account for a role tag before its content (an element's content is read in between)."""
        if not isinstance(node, RoleMark) or node.edge == "open":
            self.open(node.role, node.line, node.column)
        else:
            self.close(node.role, node.line, node.column)

    def leave(self, node: RoleNode | PromptRole | RoleMark) -> None:
        if not isinstance(node, RoleMark):
            self.close(node.role, node.line, node.column)


@dataclass(frozen=True)
class ParamSlot:
    name: str
    offset: int  # index of the first placeholder in the owner's tokens
    length: int
    scaffold_tokens: int = 0  # the slot opens with this many tokens of its scaffold text (its default)


@dataclass
class ModuleInfo:
    """One cacheable unit of a schema: a named module or an anonymous run of text."""

    name: str
    parent: str | None
    union: int | None  # id of the union this module is a member of
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # schema position of each own token
    params: dict[str, ParamSlot] = field(default_factory=dict)
    children: list[str] = field(default_factory=list)
    first_piece: int = -1  # [first_piece, last_piece]: the pieces of this module's region
    last_piece: int = -1
    line: int = 0
    column: int = 0
    # verbatim text of a pure-text module, and how many of its tokens encode that text (a
    # document module ends with a separator after its text): what drop-in detection matches
    text: str | None = None
    text_tokens: int = 0
    cache: bool = True  # cache="false": its own tokens are computed at serve time, never stored

    @property
    def anonymous(self) -> bool:
        return self.name.startswith("#")


@dataclass(frozen=True)
class Piece:
    """A run of consecutive schema positions owned by one module (text, or one parameter's slots)."""

    owner: str
    offset: int  # index of the first token in the owner's tokens
    length: int
    start: int  # schema position of the first token
    param: str | None = None


@dataclass
class SchemaLayout:
    name: str
    modules: dict[str, ModuleInfo]
    pieces: list[Piece]
    uses_roles: bool
    length: int  # schema positions used
    anonymous_pieces: list[int] = field(default_factory=list)  # indices into pieces, ascending
    # a document layout: every named module starts right after the prefix and the lead (the user
    # marker a prompt puts before its documents), and prompts may import any of them together
    # (movable modules; see document_layout)
    documents: bool = False
    lead: list[int] = field(default_factory=list)
    # per union: the member that stands for it in joint ("scaffold") encoding
    union_scaffold: dict[int, str] = field(default_factory=dict)
    open_turn: str | None = None  # the role a schema leaves open for its prompts to close (<user> ... no </user>)

    @property
    def prefix(self) -> str | None:
        """The anonymous module that opens the schema (its system prompt), if any."""
        if self.pieces and self.modules[self.pieces[0].owner].anonymous:
            return self.pieces[0].owner
        return None

    @property
    def prefix_length(self) -> int:
        prefix = self.prefix
        return len(self.modules[prefix].token_ids) if prefix is not None else 0

    @property
    def document_start(self) -> int:
        """Where documents are encoded: after the prefix and the lead."""
        return self.prefix_length + len(self.lead)

    def named_modules(self) -> list[str]:
        return [name for name, info in self.modules.items() if not info.anonymous]


def layout_schema(
    doc: SchemaDoc,
    tokenize: Tokenize,
    markers: ChatMarkers,
    placeholder_id: int,
    bos_ids: Sequence[int] = (),
) -> SchemaLayout:
    """Assign schema positions to every token of ``doc`` (paper §3.3)."""
    walker = _SchemaWalker(tokenize, markers, placeholder_id, bos_ids)
    if walker.bos:
        walker.open_run()
    walker.walk(doc.children, None)
    walker.close_anonymous()
    modules, pieces = walker.modules, walker.pieces
    for info in modules.values():
        # an empty union member is the reference's placeholder ("import nothing here"); elsewhere
        # an empty module is a mistake
        if not info.anonymous and not info.token_ids and not info.children and info.union is None:
            raise PromptCacheError(f"module {info.name!r} is empty", line=info.line, column=info.column)
    anonymous = [i for i, piece in enumerate(pieces) if modules[piece.owner].anonymous]
    return SchemaLayout(doc.name, modules, pieces, walker.uses_roles, walker.cursor, anonymous,
                        union_scaffold=walker.union_scaffold, open_turn=walker.turns.role)


class _SchemaWalker:
    """One schema's walk in document order: every module, parameter and run of text outside
    modules gets its pieces and the schema positions of its tokens (the cursor)."""

    def __init__(self, tokenize: Tokenize, markers: ChatMarkers, placeholder_id: int, bos_ids: Sequence[int]) -> None:
        self.tokenize, self.markers, self.placeholder_id = tokenize, markers, placeholder_id
        self.modules: dict[str, ModuleInfo] = {}
        self.pieces: list[Piece] = []
        self.uses_roles = False
        self.pending: dict[str, list[str]] = {}  # owner -> text not yet tokenised (merged across role markers)
        self.open_anonymous: str | None = None  # the anonymous run that text outside modules goes to
        self.bos = list(bos_ids)  # goes in front of the schema's first anonymous run
        self.cursor = 0
        self.union_scaffold: dict[int, str] = {}
        self.turns = Turns()

    # -- text and runs ------------------------------------------------------------------------------
    def flush(self, owner: str) -> None:
        """Tokenise ``owner``'s pending text into a piece at the cursor."""
        ids = self.tokenize("".join(self.pending.pop(owner, [])))
        info = self.modules[owner]
        if self.bos and info.anonymous:
            ids, self.bos = self.bos + ids, []
        if not ids:
            return
        self.pieces.append(Piece(owner, len(info.token_ids), len(ids), self.cursor))
        info.token_ids.extend(ids)
        info.positions.extend(range(self.cursor, self.cursor + len(ids)))
        self.cursor += len(ids)

    def open_run(self) -> str:
        if self.open_anonymous is None:
            self.open_anonymous = f"#{sum(1 for m in self.modules.values() if m.anonymous)}"
            self.modules[self.open_anonymous] = ModuleInfo(self.open_anonymous, None, None)
        return self.open_anonymous

    def add_text(self, owner: str | None, text: str) -> None:
        self.pending.setdefault(owner if owner is not None else self.open_run(), []).append(text)

    def close_anonymous(self) -> None:
        if self.open_anonymous is not None:
            self.flush(self.open_anonymous)
            if not self.modules[self.open_anonymous].token_ids:
                del self.modules[self.open_anonymous]
            self.open_anonymous = None

    # -- the walk -------------------------------------------------------------------------------------
    def walk(self, nodes: list[SchemaNode], owner: str | None) -> None:
        for node in nodes:
            if isinstance(node, TextNode):
                self.add_text(owner, node.text)
            elif isinstance(node, (RoleNode, RoleMark)):
                self.uses_roles = True
                start, end = self.markers.text(node)
                self.turns.enter(node)
                self.add_text(owner, start)
                self.walk(getattr(node, "children", []), owner)
                self.add_text(owner, end)
                self.turns.leave(node)
            elif isinstance(node, ParamNode):
                self.place_param(node, owner)
            elif isinstance(node, ModuleNode):
                self.place_module(node, owner, None)
            elif isinstance(node, UnionNode):
                self.place_union(node, owner)

    def place_param(self, node: ParamNode, owner: str | None) -> None:
        if owner is None:
            raise PromptCacheError(f"parameter {node.name!r} outside a module", line=node.line, column=node.column)
        info = self.modules[owner]
        if node.name in info.params:
            raise PromptCacheError(f"duplicate parameter {node.name!r} in module {owner!r}", line=node.line, column=node.column)
        self.flush(owner)
        scaffold = self.tokenize(node.scaffold) if node.scaffold else []
        if len(scaffold) > node.length:
            raise PromptCacheError(
                f"scaffold of parameter {node.name!r} is {len(scaffold)} tokens, longer than the parameter ({node.length})",
                line=node.line, column=node.column,
            )
        info.params[node.name] = ParamSlot(node.name, len(info.token_ids), node.length, len(scaffold))
        self.pieces.append(Piece(owner, len(info.token_ids), node.length, self.cursor, param=node.name))
        info.token_ids.extend(scaffold + [self.placeholder_id] * (node.length - len(scaffold)))
        info.positions.extend(range(self.cursor, self.cursor + node.length))
        self.cursor += node.length

    def place_union(self, node: UnionNode, owner: str | None) -> None:
        """Every member starts where the union does; what follows starts after the longest."""
        union_id = len(self.union_scaffold)
        scaffold = node.scaffold or node.members[0].name
        self.union_scaffold[union_id] = scaffold if owner is None else f"{owner}/{scaffold}"  # names are scoped
        if owner is not None:
            self.flush(owner)
        else:
            self.close_anonymous()
        start = end = self.cursor
        before, after = self.turns.copy(), None
        for member in node.members:
            self.cursor = start
            self.turns = before.copy()
            self.place_module(member, owner, union_id)
            end = max(end, self.cursor)
            if after is not None and self.turns.role != after.role:
                raise PromptCacheError(f"the members of this <union> leave different turns open ({after.role!r}, {self.turns.role!r})",
                                       line=node.line, column=node.column)
            after = self.turns
        self.cursor = end

    def place_module(self, node: ModuleNode, parent: str | None, union_id: int | None) -> None:
        # names are scoped by their parent, as in the reference implementation: a nested module
        # is known as "parent/name" (two unions may each hold a "default")
        name = node.name if parent is None else f"{parent}/{node.name}"
        if name in self.modules:
            first = self.modules[name]
            raise PromptCacheError(f"duplicate module name {node.name!r} (first defined at line {first.line}, column {first.column})",
                                   line=node.line, column=node.column)
        if parent is not None:
            self.flush(parent)
            self.modules[parent].children.append(name)
        else:
            self.close_anonymous()
        info = ModuleInfo(name, parent, union_id, line=node.line, column=node.column, cache=node.cache)
        self.modules[name] = info
        info.first_piece = len(self.pieces)
        self.walk(node.children, name)
        self.flush(name)
        info.last_piece = len(self.pieces) - 1
        if node.children and all(isinstance(child, TextNode) for child in node.children):
            info.text, info.text_tokens = "".join(child.text for child in node.children), len(info.token_ids)  # type: ignore[union-attr]


def document_layout(name: str, prefix_ids: Sequence[int], lead_ids: Sequence[int] = ()) -> SchemaLayout:
    """An empty layout for documents: the prefix (BOS, system turn) and nothing else yet.

    Documents are added with :func:`add_document`. Unlike a PML schema, every document starts at
    the same position, right after the prefix and ``lead_ids`` (the user-turn marker that a
    prompt puts before its documents; documents are encoded behind both, so the first document
    of a prompt sits exactly where, and behind exactly what, it was encoded), and a prompt
    imports any number of them: on a model whose modules can move, the plan places them one
    after another (compact positions).
    """
    layout = SchemaLayout(name, {}, [], uses_roles=True, length=len(prefix_ids), documents=True, lead=list(lead_ids))
    if prefix_ids:
        info = ModuleInfo("#0", None, None, list(prefix_ids), list(range(len(prefix_ids))), first_piece=0, last_piece=0)
        layout.modules["#0"] = info
        layout.pieces.append(Piece("#0", 0, len(prefix_ids), 0))
        layout.anonymous_pieces.append(0)
    return layout


def document_module(layout: SchemaLayout, name: str, text: str, text_ids: Sequence[int], separator_ids: Sequence[int],
                    behind: int = 0) -> ModuleInfo:
    """A document module (its text's tokens, then the separator's) for ``layout``, not yet added to it.

    Building and adding are separate so that the engine can encode a document before any
    prompt can see it (:func:`add_document`). ``behind``: the length of the neighbour context
    it is encoded behind (:mod:`pc_rag.prompt.neighbours`), which its positions follow.
    """
    if not layout.documents:
        raise PromptCacheError(f"schema {layout.name!r} is a PML schema, not a document collection")
    if name in layout.modules:
        raise PromptCacheError(f"duplicate module name {name!r} in schema {layout.name!r}")
    start = layout.document_start + behind
    ids = list(text_ids) + list(separator_ids)
    info = ModuleInfo(name, None, None, ids, list(range(start, start + len(ids))), first_piece=-1, last_piece=-1)
    info.text, info.text_tokens = text, len(text_ids)
    return info


def add_document(layout: SchemaLayout, info: ModuleInfo) -> None:
    """Make a module from :func:`document_module` part of ``layout`` (its piece first, then its name)."""
    if info.name in layout.modules:
        raise PromptCacheError(f"duplicate module name {info.name!r} in schema {layout.name!r}")
    index = len(layout.pieces)
    info.first_piece = info.last_piece = index
    start = info.positions[0] if info.positions else layout.document_start
    layout.pieces.append(Piece(info.name, 0, len(info.token_ids), start))
    layout.modules[info.name] = info
    layout.length = max(layout.length, start + len(info.token_ids))


def remove_documents(layout: SchemaLayout, names: Iterable[str]) -> SchemaLayout:
    """A copy of document layout ``layout`` without the documents ``names`` (``layout`` itself is
    left as it is: plans made against it keep reading it)."""
    gone = set(names)
    out = replace(layout, modules={}, pieces=[], anonymous_pieces=[], length=layout.prefix_length)
    for piece in layout.pieces:
        if piece.owner in gone:
            continue
        index = len(out.pieces)
        info = replace(layout.modules[piece.owner], first_piece=index, last_piece=index)
        if info.anonymous:
            out.anonymous_pieces.append(index)
        out.pieces.append(piece)
        out.modules[info.name] = info
        out.length = max(out.length, piece.start + piece.length)
    return out


# ---------------------------------------------------------------------------------------------
# Joint ("scaffold") encoding: the paths through a schema's unions
# ---------------------------------------------------------------------------------------------
def _choice_of(layout: SchemaLayout, name: str) -> dict[int, str]:
    """The union choices that put module ``name`` on a path: each union's scaffold member,
    overridden by ``name`` and its ancestors where they are union members."""
    chosen = dict(layout.union_scaffold)
    current: str | None = name
    while current is not None:
        info = layout.modules[current]
        if info.union is not None:
            chosen[info.union] = current
        current = info.parent
    return chosen


def _on_path(layout: SchemaLayout, name: str, chosen: dict[int, str]) -> bool:
    current: str | None = name
    while current is not None:
        info = layout.modules[current]
        if info.union is not None and chosen.get(info.union) != current:
            return False
        current = info.parent
    return True


def scaffold_paths(layout: SchemaLayout) -> list[tuple[list[Piece], list[str]]]:
    """The token paths a schema is encoded along jointly (the reference implementation's
    scaffolds): the default path takes each union's scaffold member; every other union member
    gets a path of its own that takes it instead. Returns ``(pieces in schema order, the modules
    whose KV comes from this path)`` per path; every module is encoded on exactly one path."""
    groups: dict[tuple[tuple[int, str], ...], list[str]] = {}
    for name in layout.modules:
        groups.setdefault(tuple(sorted(_choice_of(layout, name).items())), []).append(name)
    paths = []
    for key, names in groups.items():
        chosen = dict(key)
        paths.append(([piece for piece in layout.pieces if _on_path(layout, piece.owner, chosen)], names))
    return paths
