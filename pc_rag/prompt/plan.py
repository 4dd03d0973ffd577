"""The serve-time plan of a prompt (paper §3.4): for every token, whether its KV comes from the
store (cached) or is computed, and at which position.

Plan. The tokens a prompt sees are emitted in this order: walking the prompt, each imported
top-level module is preceded by the anonymous schema text that comes before it in the schema and
by the prompt text written before its reference; the module's region follows (its own tokens
and those of imported nested modules, arguments in place of parameter slots). Anonymous text
after the last import, then the prompt's trailing text, close the sequence. Uncached text and
arguments are computed; everything else is cached.

Two position policies:
- ``compact`` (models whose modules can move: RoPE and ALiBi): the emitted tokens get positions
  0, 1, 2, ... exactly as full prefill of the same token sequence would. Cached tokens whose
  encoded position differs are moved by the engine (RoPE key rotation).
- ``schema`` (learned absolute positions): cached tokens keep their schema positions; computed
  text continues after the token before it; arguments take their parameter's slots.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from ..errors import PromptCacheError
from .layout import ChatMarkers, ModuleInfo, Piece, SchemaLayout, Tokenize, Turns
from .pml import ModuleRef, PromptDoc, PromptRole, RoleMark, TextNode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens at consecutive positions, either cached or computed.

    For a cached segment, ``owner``/``offset`` locate its KV in the owner's stored tensors and
    ``source_position`` is the position that KV was encoded at (the engine moves it to
    ``position`` when they differ).
    """

    token_ids: tuple[int, ...]
    position: int
    owner: str | None = None
    offset: int = 0
    source_position: int = 0
    schema: str | None = None  # the owner's schema (the planner sets it on every cached segment)
    key: str | None = None  # the store key of the owner's KV, pinned when the prompt is planned
    # a document with a neighbour context read through its plain variant (encoded behind the
    # system turn only), where that one is exact (pc_rag.planner)
    plain: bool = False

    @property
    def cached(self) -> bool:
        return self.owner is not None

    def __len__(self) -> int:
        return len(self.token_ids)


class PlanSource(Protocol):
    """What a plan's modules were laid out from (the registry's ``Schema`` is one): read by
    recovery to know what each module's KV was encoded behind."""

    layout: SchemaLayout
    joint: Mapping[str, Any]  # scaffold paths by module name
    contexts: Mapping[str, Any]  # documents' neighbour contexts by name
    plain: Mapping[str, str]  # documents with a context: the store key of their plain variant


@dataclass
class Plan:
    segments: list[Segment]
    modules: list[str]  # imported named modules, in emission order
    schema: str | None = None
    # the schemas the plan was made against, by name (pinned: a module missing from the store is
    # encoded again from these, never from a schema registered since)
    sources: Mapping[str, PlanSource] = field(default_factory=dict, repr=False)
    # per segment, whether its cached KV is not what full prefill computes here (set by recovery)
    moved: tuple[bool, ...] | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        """The position after the prompt's last token."""
        return max(s.position + len(s) for s in self.segments)

    @property
    def input_ids(self) -> list[int]:
        return [t for s in self.segments for t in s.token_ids]

    @property
    def position_ids(self) -> list[int]:
        return [p for s in self.segments for p in range(s.position, s.position + len(s))]

    @property
    def cached_tokens(self) -> int:
        return sum(len(s) for s in self.segments if s.cached)

    @property
    def computed_tokens(self) -> int:
        return sum(len(s) for s in self.segments if not s.cached)


def close_names(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    shown = close or candidates[:8]
    more = "" if close or len(candidates) <= 8 else f" (and {len(candidates) - 8} more)"
    label = "did you mean" if close else "modules"
    return f"{label}: {', '.join(shown) or '(none)'}{more}"


def short_name(name: str) -> str:
    """A module's own name, without the names of the modules it is nested in."""
    return name.rsplit("/", 1)[-1]


def _path(layout: SchemaLayout, name: str) -> str:
    chain = []
    current: str | None = name
    while current is not None:
        chain.append(short_name(current))
        current = layout.modules[current].parent
    chain.reverse()
    return "".join(f"<{n}>" for n in chain[:-1]) + f"<{chain[-1]}/>" + "".join(f"</{n}>" for n in reversed(chain[:-1]))


def plan_prompt(
    layout: SchemaLayout,
    doc: PromptDoc,
    tokenize: Tokenize,
    markers: ChatMarkers,
    *,
    compact: bool,
    cache_anonymous: bool = True,
) -> Plan:
    """Resolve ``doc`` against ``layout``: which tokens are cached, which computed, at which positions.

    With ``cache_anonymous=False`` only the schema's opening text (its prefix) is cached among
    the always-included text; later runs (role markers, instructions between modules) are
    computed so that they attend to the modules before them, as in full prefill.
    """
    planner = _PromptPlanner(layout, tokenize, markers, compact=compact, cache_anonymous=cache_anonymous)
    items = planner.flatten(doc)
    segments, order = planner.place(items)
    if not segments:
        raise PromptCacheError("the prompt is empty: it imports nothing and has no text", line=doc.line, column=doc.column)
    return Plan(compute_last(segments), order, layout.name)


class _PromptPlanner:
    """One prompt's walk through its schema: :meth:`flatten` resolves the prompt's imports and
    role tags into text and module references, :meth:`place` lays the schema's pieces and the
    prompt's text out as segments (cached or computed, at their positions)."""

    def __init__(self, layout: SchemaLayout, tokenize: Tokenize, markers: ChatMarkers, *, compact: bool,
                 cache_anonymous: bool) -> None:
        self.layout, self.tokenize, self.markers = layout, tokenize, markers
        self.compact, self.cache_anonymous = compact, cache_anonymous
        self.imported: set[str] = set()
        self.args: dict[str, list[int]] = {}  # "<module>\x00<parameter>" -> the argument's tokens
        self.by_union: dict[int, str] = {}  # union -> the first member imported
        self.segments: list[Segment] = []
        self.next_position = 0  # compact: the next free position
        self.last_position = -1  # schema positions: the position of the last emitted token
        self.emitted_anonymous: set[int] = set()  # piece indices
        self.pending_text: list[str] = []

    # -- the prompt: imports, arguments, role tags ------------------------------------------------
    def flatten(self, doc: PromptDoc) -> list[str | ModuleRef]:
        """The prompt as text and top-level module references, imports resolved and checked."""
        items: list[str | ModuleRef] = []
        layout, markers = self.layout, self.markers
        uses_roles = layout.uses_roles
        turns = Turns(layout.open_turn)

        def walk(nodes: list) -> None:
            nonlocal uses_roles
            for node in nodes:
                if isinstance(node, TextNode):
                    items.append(node.text)
                elif isinstance(node, (PromptRole, RoleMark)):
                    uses_roles = True
                    start, end = markers.text(node)
                    turns.enter(node)
                    items.append(start)
                    walk(getattr(node, "children", []))
                    items.append(end)
                    turns.leave(node)
                else:
                    self.resolve(node, None)
                    items.append(node)

        walk(doc.children)
        # a prompt that ends inside a turn continues it (an <assistant> opened with the answer's start)
        if uses_roles and markers.generation and turns.role is None:
            items.append(markers.generation)
        return items

    def resolve(self, ref: ModuleRef, parent: str | None) -> None:
        """Record the import of ``ref`` (inside module ``parent``) and of its children, with their arguments."""
        layout = self.layout
        name = ref.name if parent is None else f"{parent}/{ref.name}"
        info = layout.modules.get(name)
        if info is None or info.anonymous:
            self._unknown(ref, parent)
        if name in self.imported and not (self.compact and layout.documents):
            # a schema's module has one place; a document placed twice is read twice, as full prefill reads it
            raise PromptCacheError(f"module {ref.name!r} is imported twice", line=ref.line, column=ref.column)
        if info.union is not None:
            other = self.by_union.get(info.union)
            if other is not None:
                # the reference implementation runs it (its SQuAD v2 test imports seven members of
                # one union); so do we, with a warning: the members share their start position
                logger.warning("modules %r and %r are members of the same <union> (line %d): both are imported, %s",
                               other, ref.name, ref.line, "one after the other" if self.compact else "at the same positions")
            self.by_union.setdefault(info.union, ref.name)
        for key, value in ref.args.items():
            self.args[f"{name}\x00{key}"] = self._argument(ref, info, key, value)
        self.imported.add(name)
        for child in ref.children:
            self.resolve(child, name)

    def _unknown(self, ref: ModuleRef, parent: str | None) -> NoReturn:
        layout = self.layout
        elsewhere = [n for n in layout.named_modules() if short_name(n) == ref.name]
        if elsewhere:
            where = "at the top level of the prompt" if parent is None else f"inside <{short_name(parent)}>"
            raise PromptCacheError(f"module {ref.name!r} cannot be imported {where}; import it as {_path(layout, elsewhere[0])}",
                                   line=ref.line, column=ref.column)
        known = sorted({short_name(n) for n in layout.named_modules()})
        raise PromptCacheError(f"unknown module <{ref.name}/> in schema {layout.name!r}; {close_names(ref.name, known)}",
                               line=ref.line, column=ref.column)

    def _argument(self, ref: ModuleRef, info: ModuleInfo, key: str, value: str) -> list[int]:
        slot = info.params.get(key)
        if slot is None:
            known = ", ".join(info.params) or "none"
            raise PromptCacheError(f"unknown parameter {key!r} for module {ref.name!r} (its parameters: {known})",
                                   line=ref.line, column=ref.column)
        ids = self.tokenize(value)
        if len(ids) > slot.length:
            raise PromptCacheError(f"argument {key}={value[:40]!r} of module {ref.name!r} is {len(ids)} tokens, "
                                   f"longer than its parameter ({slot.length} tokens)", line=ref.line, column=ref.column)
        return ids

    # -- the layout: segments at their positions --------------------------------------------------
    def place(self, items: list[str | ModuleRef]) -> tuple[list[Segment], list[str]]:
        """Segments for ``items`` in prompt order, and the imported modules' names in order."""
        order: list[str] = []
        listed: set[str] = set()
        for item in items:
            if isinstance(item, str):
                self.pending_text.append(item)
                continue
            info = self.layout.modules[item.name]
            self.flush_anonymous(info.first_piece)
            self.flush_text()
            for index in range(info.first_piece, info.last_piece + 1):
                piece = self.layout.pieces[index]
                if piece.owner not in self.imported:
                    continue
                if piece.owner not in listed:
                    listed.add(piece.owner)
                    order.append(short_name(piece.owner))
                self.emit_piece(piece)
        self.flush_anonymous(len(self.layout.pieces))
        self.flush_text()
        return self.segments, order

    def emit_piece(self, piece: Piece) -> None:
        """One piece of an imported module: its text (cached, or computed where ``cache="false"``),
        or a parameter's argument (computed) or scaffold text."""
        owner = self.layout.modules[piece.owner]
        text = owner.token_ids[piece.offset : piece.offset + piece.length]
        if piece.param is None:
            if owner.cache:
                self.emit_cached(piece)
            else:  # cache="false": computed at serve time, where the schema puts it
                self.emit_computed(text, piece.start)
            return
        argument = self.args.get(f"{piece.owner}\x00{piece.param}")
        scaffold = owner.params[piece.param].scaffold_tokens
        if argument is None and scaffold:  # no argument: the slot's scaffold text, as the schema has it
            if owner.cache:
                self.emit_cached(piece, 0, scaffold)
            else:
                self.emit_computed(text[:scaffold], piece.start)
        else:
            self.emit_computed(argument or [], piece.start)

    def emit_cached(self, piece: Piece, lo: int = 0, hi: int | None = None) -> None:
        hi = piece.length if hi is None else hi
        info = self.layout.modules[piece.owner]
        ids = tuple(info.token_ids[piece.offset + lo : piece.offset + hi])
        source = piece.start + lo
        position = self.next_position if self.compact else source
        self.segments.append(Segment(ids, position, piece.owner, piece.offset + lo, source))
        self.next_position = position + len(ids)
        self.last_position = position + len(ids) - 1

    def emit_computed(self, ids: Sequence[int], slot_start: int | None = None) -> None:
        if not ids:
            return
        if self.compact:
            position = self.next_position
        else:
            position = slot_start if slot_start is not None else self.last_position + 1
        self.segments.append(Segment(tuple(ids), position))
        self.next_position = position + len(ids)
        self.last_position = position + len(ids) - 1

    def flush_text(self) -> None:
        if self.pending_text:
            self.emit_computed(self.tokenize("".join(self.pending_text)))
            self.pending_text.clear()

    def flush_anonymous(self, before: int) -> None:
        """The schema's always-included text before piece ``before`` not emitted yet."""
        layout = self.layout
        for index in layout.anonymous_pieces:
            if index >= before:
                break
            piece = layout.pieces[index]
            if index not in self.emitted_anonymous:
                self.emitted_anonymous.add(index)
                if self.cache_anonymous or piece.owner == layout.prefix:
                    self.emit_cached(piece)
                else:
                    info = layout.modules[piece.owner]
                    self.emit_computed(info.token_ids[piece.offset : piece.offset + piece.length], piece.start)


def compute_last(segments: list[Segment]) -> list[Segment]:
    """The first generated token needs the query of the last prompt token: make sure it is computed."""
    last = segments[-1]
    if last.cached:
        segments[-1:] = [
            s
            for s in (
                Segment(last.token_ids[:-1], last.position, last.owner, last.offset, last.source_position, last.schema),
                Segment(last.token_ids[-1:], last.position + len(last) - 1),
            )
            if len(s)
        ]
    return segments


@dataclass(frozen=True)
class ModuleSpan:
    """A stored module referenced inside a plain-text prompt (its text's tokens are imported)."""

    schema: str
    name: str


