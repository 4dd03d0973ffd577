"""Prompt Markup Language: parse schemas and prompts into plain dataclasses.

PML looks like XML but is read by this small hand-written parser rather than an XML library:
PML text is untrusted (documents, user questions), so the parser must never expand entities,
read DTDs or fetch anything, it must report exact line/column positions, and it accepts the
unquoted attribute values used in the paper's Appendix A (``<module name=domestic>``).

Whitespace rules (so that indentation in a schema file does not reach the model):
- a text run that is only whitespace and contains a newline (layout between tags) is dropped;
- inside ``<schema>``, ``<prompt>`` and the role tags, the first text run loses its leading
  whitespace and the last one its trailing whitespace (the chat template supplies separators);
- everything else, module bodies included, is kept verbatim.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Collection, Union

from ..errors import PromptCacheError

ROLES = ("system", "user", "assistant")
MAX_DEPTH = 64  # deeper nesting is certainly a mistake (or an attack); reject it early

_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_ATTR = re.compile(r"\s*([A-Za-z_][\w.\-]*)\s*=\s*(\"[^\"<]*\"|'[^'<]*'|[^\s\"'<>/=`]+)")
_ENTITY = re.compile(r"&(#[0-9]{1,7}|#x[0-9A-Fa-f]{1,6}|[A-Za-z][A-Za-z0-9]*);")
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}


# ---------------------------------------------------------------------------------------------
# Generic element tree
# ---------------------------------------------------------------------------------------------
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
        m = _NAME.match(source, pos + 2)
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
        m = _NAME.match(source, pos + 1)
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


# ---------------------------------------------------------------------------------------------
# Schema and prompt dataclasses
# ---------------------------------------------------------------------------------------------
@dataclass
class TextNode:
    """Literal text; in a schema it is cached, in a prompt it is computed at serve time."""

    text: str
    line: int
    column: int


@dataclass
class ParamNode:
    """A named hole of ``length`` token positions inside a module; ``scaffold`` is the text the
    slot holds when a prompt gives no argument (the reference implementation's attribute)."""

    name: str
    length: int
    line: int
    column: int
    scaffold: str | None = None


@dataclass
class RoleNode:
    """``<system>``, ``<user>`` or ``<assistant>``: translated to the model's chat markers.
    ``bare`` is the self-closing form: ``<system/>`` is the opening the model's chat template
    writes when a conversation has no system prompt (the reference implementation's meaning)."""

    role: str
    children: list["SchemaNode"]
    line: int
    column: int
    bare: bool = False


@dataclass
class RoleMark:
    """One edge of a turn that does not nest with the modules around it: ``<user>`` opened in a
    schema and closed by its prompts, ``</user>`` inside a module closing a turn opened before
    it (the reference implementation reads role tags as text, so its files write these)."""

    role: str
    edge: str  # "open" or "close"
    line: int
    column: int


@dataclass
class ModuleNode:
    name: str
    children: list["SchemaNode"]
    line: int
    column: int
    cache: bool = True  # cache="false": computed at serve time, never stored


@dataclass
class UnionNode:
    """Mutually exclusive modules that share one start position; ``scaffold`` names the member
    that stands for the union when a schema is encoded jointly (default: the first)."""

    members: list[ModuleNode]
    line: int
    column: int
    scaffold: str | None = None


SchemaNode = Union[TextNode, ParamNode, RoleNode, RoleMark, ModuleNode, UnionNode]


@dataclass
class SchemaDoc:
    name: str
    children: list[SchemaNode]
    line: int = 1
    column: int = 1


@dataclass
class ModuleRef:
    """``<name arg="value">nested refs</name>`` inside a prompt."""

    name: str
    args: dict[str, str]
    children: list["ModuleRef"]
    line: int
    column: int


@dataclass
class PromptRole:
    role: str
    children: list["PromptNode"]
    line: int
    column: int
    bare: bool = False


PromptNode = Union[TextNode, ModuleRef, PromptRole, RoleMark]


@dataclass
class PromptDoc:
    schema: str
    children: list[PromptNode]
    line: int = 1
    column: int = 1


def _layout_ws(children: list, outer: bool) -> list:
    """Apply the whitespace rules to a child list (see module docstring); a turn's mark strips
    the text it opens or closes as its element would."""
    kept = [c for c in children if not (isinstance(c, Text) and not c.text.strip() and "\n" in c.text)]
    for i, child in enumerate(kept):
        if not isinstance(child, Text):
            continue
        after_open = (i == 0 and outer) or (i > 0 and isinstance(kept[i - 1], Mark) and kept[i - 1].edge == "open")
        before_close = (i == len(kept) - 1 and outer) or (i + 1 < len(kept) and isinstance(kept[i + 1], Mark) and kept[i + 1].edge == "close")
        text = child.text.lstrip() if after_open else child.text
        text = text.rstrip() if before_close else text
        if text != child.text:
            kept[i] = Text(text, child.line, child.column)
    return [c for c in kept if not (isinstance(c, Text) and not c.text)]


def _attr(el: Element, *names: str, required: bool = True) -> str | None:
    for name in names:
        if name in el.attrs:
            return el.attrs[name]
    if required:
        raise PromptCacheError(f"<{el.tag}> needs a {' or '.join(repr(n) for n in names)} attribute", line=el.line, column=el.column)
    return None


def _no_extra_attrs(el: Element, allowed: set[str]) -> None:
    extra = sorted(set(el.attrs) - allowed)
    if extra:
        raise PromptCacheError(f"<{el.tag}> does not take attribute(s) {', '.join(extra)}", line=el.line, column=el.column)


def _schema_children(el: Element) -> list[SchemaNode]:
    out: list[SchemaNode] = []
    outer = el.tag in ("schema",) + ROLES
    for child in _layout_ws(el.children, outer):
        if isinstance(child, Text):
            out.append(TextNode(child.text, child.line, child.column))
        elif child.tag == "module":
            _no_extra_attrs(child, {"name", "cache"})
            name = _attr(child, "name")
            if not _NAME.fullmatch(name or ""):
                raise PromptCacheError(f"invalid module name {name!r}: use letters, digits, '_', '-', '.'", line=child.line, column=child.column)
            cache = (_attr(child, "cache", required=False) or "true").lower()
            if cache not in ("true", "false"):
                raise PromptCacheError(f'module {name!r}: cache must be "true" or "false", got {cache!r}', line=child.line, column=child.column)
            out.append(ModuleNode(name, _schema_children(child), child.line, child.column, cache == "true"))
        elif child.tag == "union":
            _no_extra_attrs(child, {"scaffold"})
            members: list[ModuleNode] = []
            for member in _layout_ws(child.children, False):
                if isinstance(member, Text):
                    raise PromptCacheError("text directly inside <union>: put it inside one of its <module>s", line=member.line, column=member.column)
                if member.tag != "module":
                    raise PromptCacheError(f"<{member.tag}> inside <union>: a union holds only <module>s", line=member.line, column=member.column)
                (node,) = _schema_children(Element("_", {}, [member], member.line, member.column))
                members.append(node)  # type: ignore[arg-type]
            if not members:
                raise PromptCacheError("empty <union>", line=child.line, column=child.column)
            scaffold = _attr(child, "scaffold", required=False)
            if scaffold is not None and scaffold not in [m.name for m in members]:
                raise PromptCacheError(
                    f"union scaffold {scaffold!r} is not one of its modules ({', '.join(m.name for m in members)})",
                    line=child.line, column=child.column,
                )
            out.append(UnionNode(members, child.line, child.column, scaffold))
        elif child.tag in ("param", "parameter"):
            _no_extra_attrs(child, {"name", "len", "length", "scaffold"})
            if child.children:
                raise PromptCacheError(f"<{child.tag}> must be empty: write <{child.tag} name=\"...\" len=\"N\"/>", line=child.line, column=child.column)
            name = _attr(child, "name")
            raw_len = _attr(child, "len", "length")
            if not (raw_len or "").isdigit() or int(raw_len) < 1:
                raise PromptCacheError(f"parameter {name!r} needs a positive integer length, got {raw_len!r}", line=child.line, column=child.column)
            out.append(ParamNode(name, int(raw_len), child.line, child.column, _attr(child, "scaffold", required=False)))  # type: ignore[arg-type]
        elif isinstance(child, Mark):
            out.append(RoleMark(child.tag, child.edge, child.line, child.column))
        elif child.tag in ROLES:
            _no_extra_attrs(child, set())
            out.append(RoleNode(child.tag, _schema_children(child), child.line, child.column, bare=child.empty))
        else:
            raise PromptCacheError(
                f"unknown tag <{child.tag}> in schema (expected module, union, param, parameter, system, user, assistant)",
                line=child.line,
                column=child.column,
            )
    return out


def parse_schema(source: str) -> SchemaDoc:
    """Parse ``<schema name="...">...</schema>`` text."""
    root = parse_markup(source, loose=ROLES)
    if root.tag != "schema":
        raise PromptCacheError(f"expected <schema> as the root element, got <{root.tag}>", line=root.line, column=root.column)
    _no_extra_attrs(root, {"name"})
    name = _attr(root, "name")
    return SchemaDoc(name, _schema_children(root), root.line, root.column)  # type: ignore[arg-type]


def _prompt_children(el: Element) -> list[PromptNode]:
    out: list[PromptNode] = []
    outer = el.tag in ("prompt",) + ROLES
    for child in _layout_ws(el.children, outer):
        if isinstance(child, Text):
            out.append(TextNode(child.text, child.line, child.column))
        elif isinstance(child, Mark):
            out.append(RoleMark(child.tag, child.edge, child.line, child.column))
        elif child.tag in ROLES:
            _no_extra_attrs(child, set())
            out.append(PromptRole(child.tag, _prompt_children(child), child.line, child.column, bare=child.empty))
        elif child.tag in ("prompt", "schema", "module", "union", "param", "parameter"):
            raise PromptCacheError(f"<{child.tag}> is not allowed inside a prompt", line=child.line, column=child.column)
        else:
            out.append(_module_ref(child))
    return out


def _module_ref(el: Element) -> ModuleRef:
    nested: list[ModuleRef] = []
    for child in _layout_ws(el.children, False):
        if isinstance(child, Text):
            raise PromptCacheError(
                f"text inside the reference <{el.tag}>: only nested module references go there; put text before or after it",
                line=child.line,
                column=child.column,
            )
        if isinstance(child, Mark):
            raise PromptCacheError(f"a <{child.tag}> turn edge inside the reference <{el.tag}>: put it before or after it", line=child.line, column=child.column)
        nested.append(_module_ref(child))
    return ModuleRef(el.tag, dict(el.attrs), nested, el.line, el.column)


def parse_prompt(source: str) -> PromptDoc:
    """Parse ``<prompt schema="...">...</prompt>`` text."""
    root = parse_markup(source, loose=ROLES)
    if root.tag != "prompt":
        raise PromptCacheError(f"expected <prompt> as the root element, got <{root.tag}>", line=root.line, column=root.column)
    _no_extra_attrs(root, {"schema"})
    schema = _attr(root, "schema")
    return PromptDoc(schema, _prompt_children(root), root.line, root.column)  # type: ignore[arg-type]


class PML(str):
    """A prompt to be read as PML (``<prompt schema="...">``), not as text.

    PML is an explicit input: a plain ``str`` is always plain text, whatever it starts with, so
    a question, a document or anything a chain passes in can never import a module by writing
    markup. :func:`pc_rag.build_prompt` returns a ``PML``; wrap a prompt you wrote yourself:
    ``engine.generate(PML('<prompt schema="kb"><a/> Why?</prompt>'))``. Any string operation on
    it (concatenation, formatting, ``str()``) gives plain text again.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"PML({str.__repr__(self)})"


def is_pml_prompt(text: str) -> bool:
    """True when ``text`` is a PML prompt (starts with ``<prompt``), False for plain text."""
    return re.match(r"\s*(<\?[^>]*\?>\s*)?<prompt[\s>/]", text) is not None


def escape(text: str) -> str:
    """Escape text so that it is read back verbatim as PML text, never as markup."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
