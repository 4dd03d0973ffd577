"""PML's syntax: text into a tree of elements, before any PML meaning (:mod:`pc_rag.prompt.pml`).

A small hand-written parser rather than an XML library: PML text is untrusted (documents, user
questions), so it never expands entities, reads DTDs or fetches anything, it reports exact
line/column positions, and it accepts the unquoted attribute values of the paper's Appendix A
(``<module name=domestic>``). Role tags may be "loose": left open or closed across other
elements, as the reference implementation's schemas write them (:class:`Mark`).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Collection, Union

from ..errors import PromptCacheError

MAX_DEPTH = 64  # deeper nesting is certainly a mistake (or an attack); reject it early

NAME = re.compile(r"[A-Za-z_][\w.\-]*")  # a tag, attribute or module name
_ATTR = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*=\s*(\"[^\"<]*\"|'[^'<]*'|[^\s\"'<>/=`]+)")
_ENTITY = re.compile(r"&(#[0-9]{1,7}|#x[0-9A-Fa-f]{1,6}|[A-Za-z][A-Za-z0-9]*);")
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}


@dataclass
class Text:
    text: str
    line: int
    column: int


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Union["Element", Text, "Mark"]]
    line: int
    column: int
    empty: bool = False  # written self-closing (<system/>)


@dataclass
class Mark:
    """One edge of a role tag that does not nest with the elements around it: ``<user>`` left
    open (a schema opens the turn its prompts close), ``</user>`` closing a turn opened outside
    the element it stands in. The reference implementation substitutes role tags as text before
    it parses, so its schemas and prompts write these; a well-nested role tag stays an element."""

    tag: str
    edge: str  # "open" or "close"
    line: int
    column: int


class _Lines:
    """Line and column of any offset of one source, found by bisection over its line starts
    (counted once): parsing stays linear in the input, however many elements it has."""

    def __init__(self, source: str) -> None:
        self.starts = [0]
        self.starts.extend(m.end() for m in re.finditer("\n", source))

    def at(self, offset: int) -> tuple[int, int]:
        line = bisect_right(self.starts, offset)
        return line, offset - self.starts[line - 1] + 1


def _line_col(source: str, offset: int) -> tuple[int, int]:
    """Line and column of ``offset`` (for one-off error messages; parsing uses :class:`_Lines`)."""
    line = source.count("\n", 0, offset) + 1
    return line, offset - (source.rfind("\n", 0, offset) + 1) + 1


def _error(source: str, offset: int, message: str) -> PromptCacheError:
    line, column = _line_col(source, offset)
    return PromptCacheError(message, line=line, column=column)


def _unescape(source: str, start: int, raw: str) -> str:
    """Decode the five XML entities and character references; an unknown ``&name;`` is an error,
    a ``&`` that starts no entity is itself.

    ``start`` is the offset of ``raw`` in ``source`` (for error positions). Custom entities are
    never expanded, so entity-expansion bombs cannot exist.
    """
    if "&" not in raw:
        return raw
    out: list[str] = []
    pos = 0
    for m in _ENTITY.finditer(raw):
        out.append(raw[pos : m.start()])
        body = m.group(1)
        if body.startswith("#x"):
            code = int(body[2:], 16)
        elif body.startswith("#"):
            code = int(body[1:])
        elif body in _NAMED_ENTITIES:
            out.append(_NAMED_ENTITIES[body])
            pos = m.end()
            continue
        else:
            raise _error(source, start + m.start(), f"unknown entity '&{body};' (PML knows only &lt; &gt; &amp; &quot; &apos; and &#N;)")
        if code == 0 or code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise _error(source, start + m.start(), f"invalid character reference '&{body};'")
        out.append(chr(code))
        pos = m.end()
    out.append(raw[pos:])
    # a '&' that starts no entity ("AT&T", "R&D", "a && b") is the character itself, as the
    # reference implementation's own schemas write it (its parser silently damages such text; we keep it)
    return "".join(out)


def parse_markup(source: str, loose: Collection[str] = ()) -> Element:
    """Parse PML text into a single root :class:`Element` (syntax only, no PML semantics).

    Tags in ``loose`` (the role tags, for schemas and prompts) may be left open or closed
    across other elements: such an edge becomes a :class:`Mark` where it stands.
    """
    if not isinstance(source, str):
        raise PromptCacheError(f"PML must be a str, got {type(source).__name__}")
    return _MarkupParser(source, loose).parse()


class _MarkupParser:
    """A hand-written scanner for PML's subset of XML (see the module docstring for why not an
    XML library): one pass over the source, a stack of open elements, positions for every error."""

    def __init__(self, source: str, loose: Collection[str]) -> None:
        self.source, self.loose = source, loose
        self.pos = 0
        self.stack: list[Element] = []
        self.root: Element | None = None
        self.lines = _Lines(source)

    def parse(self) -> Element:
        source, stack = self.source, self.stack
        while self.pos < len(source):
            lt = source.find("<", self.pos)
            if lt == -1:
                self.add_text(_unescape(source, self.pos, source[self.pos :]), self.pos)
                break
            if lt > self.pos:
                self.add_text(_unescape(source, self.pos, source[self.pos : lt]), self.pos)
            self.pos = lt
            if source.startswith("<![CDATA[", lt):
                end = self.find("]]>", lt + 9, "unterminated <![CDATA[ section")
                self.add_text(source[lt + 9 : end], lt)
                self.pos = end + 3
            elif source.startswith("<!--", lt):
                self.pos = self.find("-->", lt + 4, "unterminated comment") + 3
            elif source.startswith("<?", lt):
                if stack or self.root is not None:
                    raise _error(source, lt, "processing instructions are only allowed before the root element")
                self.pos = self.find("?>", lt + 2, "unterminated <? ... ?>") + 2
            elif source.startswith("<!", lt):
                raise _error(source, lt, "DTDs and <!...> declarations are not allowed in PML")
            elif source.startswith("</", lt):
                self.close_tag()
            else:
                self.open_tag()
        while len(stack) > 1 and stack[-1].tag in self.loose:  # a turn left open for what follows the document
            _unwrap(stack[-2], stack.pop())
        if stack:
            top = stack[-1]
            raise PromptCacheError(f"<{top.tag}> is never closed", line=top.line, column=top.column)
        if self.root is None:
            raise PromptCacheError("empty PML document: expected <schema ...> or <prompt ...>", line=1, column=1)
        return self.root

    def find(self, end: str, start: int, problem: str) -> int:
        at = self.source.find(end, start)
        if at == -1:
            raise _error(self.source, self.pos, problem)
        return at

    def add_text(self, text: str, offset: int) -> None:
        if not self.stack:
            if text.strip():
                raise _error(self.source, offset, "text outside the root element")
            return
        children = self.stack[-1].children
        if children and isinstance(children[-1], Text):
            children[-1].text += text
        else:
            line, column = self.lines.at(offset)
            children.append(Text(text, line, column))

    def close_tag(self) -> None:
        source, stack, loose, pos = self.source, self.stack, self.loose, self.pos
        m = NAME.match(source, pos + 2)
        if not m:
            raise _error(source, pos, "expected a tag name after '</'")
        tag = m.group(0)
        close = re.compile(r"\s*>").match(source, m.end())
        if not close:
            raise _error(source, m.end(), f"expected '>' to close </{tag}>")
        self.pos = close.end()
        if stack and stack[-1].tag in loose and stack[-1].tag != tag and any(e.tag == tag for e in stack):
            while len(stack) > 1 and stack[-1].tag != tag and stack[-1].tag in loose:  # turns left open inside it
                _unwrap(stack[-2], stack.pop())
        if tag in loose and stack and stack[-1].tag != tag:
            _close_loose(stack, tag, self.lines.at(pos))
            return
        if not stack:
            raise _error(source, pos, f"closing tag </{tag}> without an opening tag")
        if stack[-1].tag != tag:
            top = stack[-1]
            raise _error(source, pos, f"</{tag}> closes <{top.tag}> opened at line {top.line}, column {top.column}")
        stack.pop()

    def open_tag(self) -> None:
        source, pos = self.source, self.pos
        m = NAME.match(source, pos + 1)
        if not m:
            # a '<' that starts no tag ("a < b", "<3", "<=") is the character itself, as in the
            # reference implementation's own schemas; "<b" starts a tag and must be &lt;b
            self.add_text("<", pos)
            self.pos += 1
            return
        tag = m.group(0)
        attrs, cursor = self.attributes(tag, m.end())
        end = re.compile(r"\s*(/?)>").match(source, cursor)
        if not end:
            raise _error(source, cursor, f"malformed tag <{tag}>: expected attributes name=\"value\" then '>' or '/>'")
        line, column = self.lines.at(pos)
        element = Element(tag, attrs, [], line, column, empty=bool(end.group(1)))
        if self.stack:
            self.stack[-1].children.append(element)
        elif self.root is None:
            self.root = element
        else:
            raise _error(source, pos, f"second root element <{tag}>: a PML document has exactly one root")
        if not end.group(1):
            if len(self.stack) >= MAX_DEPTH:
                raise _error(source, pos, f"elements nested deeper than {MAX_DEPTH} levels")
            self.stack.append(element)
        self.pos = end.end()

    def attributes(self, tag: str, cursor: int) -> tuple[dict[str, str], int]:
        """The attributes of ``<tag`` from ``cursor`` on, and where they end."""
        attrs: dict[str, str] = {}
        while True:
            am = _ATTR.match(self.source, cursor)
            if not am:
                return attrs, cursor
            key, value = am.group(1), am.group(2)
            if key in attrs:
                raise _error(self.source, cursor, f"duplicate attribute '{key}' on <{tag}>")
            if value[0] in "\"'":
                value = _unescape(self.source, am.start(2) + 1, value[1:-1])
            attrs[key] = value
            cursor = am.end()


def _unwrap(parent: Element, element: Element) -> None:
    """Replace ``element`` among ``parent``'s children by an opening mark and its children."""
    if element.attrs:
        raise PromptCacheError(f"<{element.tag}> does not take attribute(s) {', '.join(sorted(element.attrs))}", line=element.line, column=element.column)
    at = next(i for i, child in enumerate(parent.children) if child is element)
    parent.children[at : at + 1] = [Mark(element.tag, "open", element.line, element.column), *element.children]


def _close_loose(stack: list[Element], tag: str, where: tuple[int, int]) -> None:
    """``</tag>`` where the innermost open element is another: the turn ``tag`` opened further
    out (if any) becomes an opening mark, and the closing edge a mark inside the current element."""
    for depth in range(len(stack) - 1, 0, -1):
        if stack[depth].tag == tag:
            _unwrap(stack[depth - 1], stack.pop(depth))
            break
    stack[-1].children.append(Mark(tag, "close", *where))
