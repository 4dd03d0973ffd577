"""Planning: a prompt and a registry snapshot -> a :class:`~pc_rag.prompt.plan.Plan`; recovery; admission.

Pure functions of their arguments. A plan lists the prompt's tokens as segments at explicit
positions; each cached segment carries the store key of the KV it reads and its schema, pinned
here, so a request finishes on the KV it was planned with whatever is registered meanwhile.

- :func:`plan`: PML prompts resolve against their schema's layout; plain text is tokenised once,
  as the tokenizer would, honours module references, and reuses the KV of known module text
  found verbatim where the prompt's tokens are the module's (drop-in).
- :func:`recover`: which cached tokens are recomputed at serve time instead (fidelity).
- :func:`admit`: refuse, before any work, what cannot be served (window, memory budget).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import replace
from types import MappingProxyType
from typing import Any

from .errors import ContextWindowExceeded, PromptCacheError, UnknownModule
from .model.spec import ModelSpec
from .prefill.recovery import encoded_behind
from .prompt.documents import split_references
from .prompt.plan import ModuleSpan, Plan, Segment, close_names, compute_last, plan_prompt
from .prompt.pml import PML, parse_prompt
from .registry_snapshot import Schema, Snapshot


def scope(collections: str | Iterable[str] | None) -> frozenset[str] | None:
    """A request's ``collections=`` as a set of names (None: every collection, single-user use)."""
    if collections is None:
        return None
    names = [collections] if isinstance(collections, str) else list(collections) if isinstance(collections, Iterable) else None
    if names is None or not all(isinstance(n, str) for n in names):
        raise PromptCacheError(f"collections must be a collection name or a list of them, got {collections!r:.120}")
    return frozenset(names)


def visible(snapshot: Snapshot, collections: frozenset[str] | None) -> Snapshot:
    """The part of ``snapshot`` a request scoped to ``collections`` may read."""
    if collections is None:
        return snapshot
    return Snapshot(MappingProxyType({n: s for n, s in snapshot.schemas.items() if n in collections}), snapshot.index)


def plan(prompt: str, snapshot: Snapshot, spec: ModelSpec, *, encoding: str, drop_in: bool,
         collections: frozenset[str] | None = None) -> Plan:
    """Which tokens of ``prompt`` are cached (and where their KV is stored) and which computed, at which positions.

    A :class:`~pc_rag.prompt.pml.PML` prompt is read as markup; any other ``str`` is plain text, even one
    that looks like markup (untrusted text never becomes structure).

    ``collections`` scopes the request: nothing outside those collections is imported, matched
    by drop-in or named in an error (a schema or reference outside them reads exactly as one
    that does not exist), so the plan, its statistics and its timing are those of an engine
    that holds only these collections.
    """
    if not isinstance(prompt, str):
        raise PromptCacheError(f"prompt must be a str (plain text) or a PML prompt, got {type(prompt).__name__}")
    snapshot = visible(snapshot, collections)
    if isinstance(prompt, PML):  # markup only when the caller says so: a plain str is always text
        planned = _plan_pml(prompt, snapshot, spec, encoding)
    else:
        planned = _plan_plain(prompt, snapshot, spec, drop_in and spec.movable)
    planned = _exact_variants(_pin(planned, snapshot), encoding)
    if not spec.movable:
        _check_increasing(planned, spec)
    return planned


def _plan_pml(prompt: str, snapshot: Snapshot, spec: ModelSpec, encoding: str) -> Plan:
    doc = parse_prompt(prompt)
    schema = snapshot.schemas.get(doc.schema)
    if schema is None:
        known = ", ".join(sorted(snapshot.schemas)) or "none"
        raise PromptCacheError(f"unknown schema {doc.schema!r} (schemas this request may read: {known})", line=doc.line, column=doc.column)
    return plan_prompt(schema.layout, doc, spec.tokenize, spec.markers, compact=spec.movable,
                       cache_anonymous=encoding in ("isolated", "scaffold"))


def _plan_plain(prompt: str, snapshot: Snapshot, spec: ModelSpec, drop_in: bool) -> Plan:
    """Plain text, tokenised as the tokenizer would: honour module references, and reuse the KV of
    known module text found verbatim wherever the prompt's tokens are the module's tokens.

    A module reference (secret-carrying, see :mod:`pc_rag.prompt.documents`) stands for the module's
    stored tokens; the text between references is tokenised once per run of text, as a whole.
    """
    bos = [] if spec.bos_text and prompt.startswith(spec.bos_text) else list(spec.bos_ids)  # a chat template may render BOS itself
    segments: list[Segment] = [Segment(tuple(bos), 0)] if bos else []
    order: list[str] = []
    position = len(bos)
    for piece in split_references(prompt):
        if isinstance(piece, ModuleSpan):
            info = _referenced(piece, snapshot, spec)
            n = info.text_tokens
            segments.append(Segment(tuple(info.token_ids[:n]), position, piece.name, 0, info.positions[0], piece.schema))
            position += n
            order.append(piece.name)
            continue
        position = _plan_text(piece, position, snapshot, spec, drop_in, segments, order)
    if not segments:
        raise PromptCacheError("the prompt is empty")
    return Plan(compute_last(segments), order)


def _plan_text(text: str, position: int, snapshot: Snapshot, spec: ModelSpec, drop_in: bool,
               segments: list[Segment], order: list[str]) -> int:
    """Append ``text``'s segments from ``position`` on; returns the position after them.

    The text is tokenised once. Each module text found in it (drop-in) is aligned with it token
    by token through character offsets: a prompt token is reused from the module where it covers
    the same characters as a module token and is the same token. Where the boundary merges
    differently (``"Context: " + doc`` gives ``' Super'`` where the document alone starts with
    ``'Super'``) that token is computed and the rest of the module is reused from there on.
    """
    if not text:
        return position
    encoded = spec.tokenizer(text, add_special_tokens=False, return_offsets_mapping=drop_in)
    ids: list[int] = encoded["input_ids"]
    reused: list[tuple[int, int, str, str, int]] = []  # (first prompt token, end, schema, module, module offset)
    if drop_in and ids:
        offsets = encoded["offset_mapping"]
        ends = [end for _, end in offsets]
        for match in snapshot.index.find(text, snapshot.schemas):
            info = snapshot.schemas[match.schema].layout.modules.get(match.name)
            if info is None:  # indexed after this snapshot's schema was published
                continue
            reused.extend(_aligned_runs(match.start, match.end, ids, offsets, ends, info, spec, match.schema))
    cursor = 0
    for first, end, schema, name, offset in reused:
        if first > cursor:
            segments.append(Segment(tuple(ids[cursor:first]), position + cursor))
        info = snapshot.schemas[schema].layout.modules[name]
        segments.append(Segment(tuple(ids[first:end]), position + first, name, offset, info.positions[offset], schema))
        if not name.startswith("#") and (not order or order[-1] != name):  # a quoted system turn is not an imported module
            order.append(name)
        cursor = end
    if cursor < len(ids):
        segments.append(Segment(tuple(ids[cursor:]), position + cursor))
    return position + len(ids)


def _aligned_runs(start: int, stop: int, ids: list[int], offsets: list[tuple[int, int]], ends: list[int],
                  info: Any, spec: ModelSpec, schema: str) -> list[tuple[int, int, str, str, int]]:
    """The runs of prompt tokens that are module ``info``'s own tokens, for its text found at
    characters ``[start, stop)``: ``(first prompt token, end, schema, module, module offset)``."""
    module_ids = info.token_ids[: info.text_tokens]
    module_offsets = spec.offsets(info.text)
    if len(module_offsets) != len(module_ids):  # a tokenizer that does not round-trip this text: compute it
        return []
    runs: list[tuple[int, int, str, str, int]] = []
    j = bisect_right(ends, start)  # the first prompt token that ends inside the text
    k = 0
    while k < len(module_ids) and j < len(ids) and offsets[j][0] < stop:
        prompt_span = offsets[j]
        module_span = (start + module_offsets[k][0], start + module_offsets[k][1])
        if prompt_span == module_span:
            if ids[j] == module_ids[k]:
                if runs and runs[-1][1] == j and runs[-1][4] + (j - runs[-1][0]) == k:
                    runs[-1] = (runs[-1][0], j + 1, schema, info.name, runs[-1][4])
                else:
                    runs.append((j, j + 1, schema, info.name, k))
            j += 1
            k += 1
        elif prompt_span < module_span:
            j += 1
        else:
            k += 1
    return runs


def _referenced(ref: ModuleSpan, snapshot: Snapshot, spec: ModelSpec) -> Any:
    schema = snapshot.schemas.get(ref.schema)
    if schema is None:
        raise PromptCacheError(f"module reference to unknown schema {ref.schema!r} "
                               f"(schemas this request may read: {', '.join(sorted(snapshot.schemas)) or 'none'})")
    info = schema.layout.modules.get(ref.name)
    if info is None or info.anonymous:
        raise UnknownModule(f"module reference to unknown module {ref.name!r} in schema {ref.schema!r}; "
                            f"{close_names(ref.name, schema.layout.named_modules())}", schema=ref.schema, name=ref.name)
    if info.text is None:
        raise PromptCacheError(f"module {ref.name!r} has parameters or nested modules: import it with a PML prompt")
    if not spec.movable:
        raise PromptCacheError(f"module {ref.name!r} cannot move on a model with {spec.pinned_reason}")
    return info


def _pin(planned: Plan, snapshot: Snapshot) -> Plan:
    """Every cached segment gets its schema's name and its store key; the plan keeps the schemas."""
    sources: dict[str, Schema] = {}
    segments: list[Segment] = []
    for segment in planned.segments:
        if segment.cached:
            name = segment.schema or planned.schema
            schema = snapshot.schemas[name]  # type: ignore[index]
            sources[name] = schema  # type: ignore[index]
            segment = replace(segment, schema=name, key=schema.keys[segment.owner])  # type: ignore[index]
            joint = schema.joint.get(segment.owner)  # type: ignore[union-attr]
            if joint is not None:  # encoded on a path: its KV sits at the path's positions
                segment = replace(segment, source_position=joint.positions[joint.index[segment.offset]])
        segments.append(segment)
    return replace(planned, segments=segments, sources=sources)


def _exact_variants(planned: Plan, encoding: str) -> Plan:
    """A document stored in two variants (behind its neighbours, and plain: behind the system turn
    only, :mod:`pc_rag.prompt.neighbours`) is read through the one that is exact where the prompt
    places it: the contextual one right after its context, the plain one right after the system
    turn (the first document of a prompt). Anywhere else it reads the contextual one, which holds
    more of what a neighbour-ordered prompt puts before it, and is recovered as a moved module."""
    if not any(source.plain for source in planned.sources.values()):
        return planned
    segments: list[Segment] = []
    preceding: list[int] = []  # the prompt's tokens before the segment at hand
    for segment in planned.segments:
        before = len(preceding)
        preceding.extend(segment.token_ids)
        source = planned.sources.get(segment.schema) if segment.cached else None  # type: ignore[arg-type]
        plain_key = source.plain.get(segment.owner) if source is not None else None  # type: ignore[arg-type]
        if plain_key is not None:
            at = segment.source_position - len(source.contexts[segment.owner].token_ids)  # type: ignore[union-attr, index]
            # (where the plain variant is exact the contextual one is not: their positions differ)
            if segment.position == at and preceding[:before] == encoded_behind(source, segment.owner, segment.offset, encoding,  # type: ignore[arg-type]
                                                                               plain=True):
                segment = replace(segment, key=plain_key, source_position=at, plain=True)
        segments.append(segment)
    return replace(planned, segments=segments)


def _check_increasing(planned: Plan, spec: ModelSpec) -> None:
    """Modules that cannot move keep their schema positions, so text placed before one may run
    into them; two tokens at one position are not a prompt full prefill could read."""
    last = -1
    for index, segment in enumerate(planned.segments):
        if segment.position <= last and not _union_siblings(planned, planned.segments[index - 1], segment):
            previous = planned.segments[index - 1]
            what = f"module {segment.owner!r}" if segment.cached else "the text after it"
            before = f"module {previous.owner!r}" if previous.cached else f"text ({len(previous)} tokens)"
            raise PromptCacheError(
                f"{before} ends at position {last}, but {what} starts at position {segment.position}: positions must "
                f"increase, and modules keep their schema positions on a model with {spec.pinned_reason}. Put the text "
                "where the schema leaves room (after the last module, or in place of a shorter union member), "
                "or import the modules in schema order"
            )
        last = segment.position + len(segment) - 1


def _union_siblings(planned: Plan, previous: Segment, segment: Segment) -> bool:
    """Two members of one union imported together: they share their start position, as in the
    reference implementation (the planner warned when it placed them)."""
    if not (previous.cached and segment.cached and previous.schema == segment.schema and previous.owner != segment.owner):
        return False
    modules = planned.sources[segment.schema].layout.modules  # type: ignore[index]
    union = modules[segment.owner].union  # type: ignore[index]
    return union is not None and modules[previous.owner].union == union  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# Admission
# ---------------------------------------------------------------------------------------------
def admit(plans: Sequence[Plan], spec: ModelSpec, *, use_cache: bool, memory_budget: int | None, kv_bytes_per_token: int) -> None:
    """Refuse, before any work, a request (or a whole batch) that cannot be served."""
    several = len(plans) > 1
    for index, planned in enumerate(plans):
        what = f"prompt {index}" if several else "the prompt"
        end = planned.end
        if spec.context_window is not None and end > spec.context_window:
            why = f": {spec.context_reason}" if spec.context_reason else ""
            raise ContextWindowExceeded(f"{what} needs {end} positions, more than the model's context window ({spec.context_window}){why}",
                                        param="prompt")
        if use_cache and spec.exact_window is not None and end > spec.exact_window and planned.cached_tokens:
            raise PromptCacheError(
                f"{what} needs {end} positions; this model has {spec.pinned_reason}, so cached KV is exact only within "
                f"{spec.exact_window} positions (use use_cache=False for longer prompts)"
            )
    if not use_cache or memory_budget is None:
        return
    # the module KV the requests import, each stored entry counted once (a batch shares it)
    distinct = {(s.key, s.offset, len(s)) for planned in plans for s in planned.segments if s.cached}
    tokens = sum(length for _, _, length in distinct)
    needed = tokens * kv_bytes_per_token
    if needed > memory_budget:
        who = f"the {len(plans)} prompts import" if several else "the prompt imports"
        raise PromptCacheError(
            f"{who} {tokens} cached tokens ({needed:,} bytes of KV), more than memory_budget "
            f"({memory_budget:,} bytes); raise the budget or import fewer modules"
        )
