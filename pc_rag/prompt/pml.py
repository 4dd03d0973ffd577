"""Prompt Markup Language: parse schemas and prompts into plain dataclasses.

PML looks like XML but is read by a small hand-written parser (:mod:`pc_rag.prompt.markup`,
its syntax) rather than an XML library: PML text is untrusted (documents, user questions).
This module gives the tree its meaning: schemas, modules, parameters, unions, roles, prompts.

Whitespace rules (so that indentation in a schema file does not reach the model):
- a text run that is only whitespace and contains a newline (layout between tags) is dropped;
- inside ``<schema>``, ``<prompt>`` and the role tags, the first text run loses its leading
  whitespace and the last one its trailing whitespace (the chat template supplies separators);
- everything else, module bodies included, is kept verbatim.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

from ..errors import PromptCacheError
from .markup import NAME, Element, Mark, Text, parse_markup

ROLES = ("system", "user", "assistant")

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
            if not NAME.fullmatch(name or ""):
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
