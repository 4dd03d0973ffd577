"""Neighbour context: which documents each document is encoded behind, and prompt orders that reuse it.

A document encoded on its own never attended to the documents a prompt places before it. Encoded
behind the documents it is most likely to be retrieved with (``add_documents(context="neighbours")``),
its KV already holds most of what it would read in the prompt, and the cost is paid once, at
encoding, instead of in every request (recovery). Its neighbours are the ``k`` documents of its
collection nearest to it by the retriever's embeddings, the farthest first, so that the nearest
sits right before it, where a reordered prompt (:func:`reorder`) places it. Only the document's
own KV is stored: storage does not grow.

A prompt that places a document right after exactly its context (same neighbours, same order,
right after the system turn) reads exactly what full prefill computes for it; elsewhere it is
a moved module like any other and recovered as configured (:mod:`pc_rag.prefill.recovery`).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import PromptCacheError

logger = logging.getLogger(__name__)

# what context= takes: each neighbour's whole text, or only its first sentence (a shorter
# context: cheaper to encode, never exact)
CONTEXTS: tuple[str, ...] = ("neighbours", "neighbour_sentences")
# one neighbour: with the plain copy each document is also stored as, it keeps encoding within 3x
# the plain encoding (2.6-3.0x measured) at a first-token KL within 0.05 on every set measured;
# two lower the KL further (docs/quality.md) at 2.8-4.2x
DEFAULT_NEIGHBOURS = 1
MAX_NEIGHBOURS = 64  # more is not a context a prompt could follow; a record claiming more is malformed

_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


@dataclass(frozen=True)
class DocumentContext:
    """What a document was encoded behind after the system turn and the user marker."""

    names: tuple[str, ...]  # its neighbours, the farthest first (the nearest right before it)
    token_ids: tuple[int, ...] = field(repr=False)  # their tokens, as a prompt places them
    form: str = "neighbours"  # whole texts, or first sentences (one of CONTEXTS)


def check_context(context: Any, neighbours: Any) -> tuple[str | None, int]:
    """``(context, k)`` validated: ``context`` None (each document behind the system turn only)
    or one of :data:`CONTEXTS`; ``neighbours`` an int >= 0 (0: no context)."""
    if context is not None and context not in CONTEXTS:
        raise PromptCacheError(f"unknown context={context!r}: use None, {', '.join(repr(c) for c in CONTEXTS)}")
    if isinstance(neighbours, bool) or not isinstance(neighbours, int) or not 0 <= neighbours <= MAX_NEIGHBOURS:
        raise PromptCacheError(f"neighbours must be an int from 0 to {MAX_NEIGHBOURS}, got {neighbours!r}")
    return context, neighbours


def first_sentence(text: str) -> str:
    """The text up to its first sentence end (all of it when it has none)."""
    parts = _SENTENCE_END.split(text.strip(), maxsplit=1)
    return parts[0]


def nearest(queries: np.ndarray, corpus: np.ndarray, k: int, *, exclude: Sequence[int] | None = None) -> list[list[int]]:
    """For each row of ``queries`` (unit vectors), the indexes of its ``k`` most similar rows of
    ``corpus``, most similar first; ``exclude[i]`` (the query's own row in ``corpus``) is never
    its own neighbour. Ties go to the lower index, so the answer does not depend on the machine."""
    if k <= 0 or len(corpus) == 0:
        return [[] for _ in range(len(queries))]
    out: list[list[int]] = []
    for start in range(0, len(queries), 1024):  # blocks: a large corpus never needs a queries x corpus matrix at once
        scores = queries[start : start + 1024] @ corpus.T
        if exclude is not None:
            rows = np.arange(scores.shape[0])
            own = np.asarray(exclude[start : start + 1024])
            valid = own >= 0
            scores[rows[valid], own[valid]] = -np.inf
        for row in scores:
            order = np.lexsort((np.arange(len(row)), -row))  # by score, then index
            out.append([int(i) for i in order[:k] if np.isfinite(row[i])])
    return out


class NeighbourIndex:
    """The embeddings of a collection's documents, for choosing each new document's neighbours.

    Held per collection by the engine; documents the collection held before the index existed
    are embedded when first needed. ``embed`` maps texts to unit vectors (the retriever's
    embedding model, so that neighbours are the documents retrieved together).
    """

    def __init__(self, embed: Callable[[list[str]], np.ndarray]) -> None:
        self.embed = embed
        self.names: list[str] = []
        self.vectors = np.zeros((0, 0), dtype=np.float32)
        self._rows: dict[str, int] = {}
        self._texts: dict[str, str] = {}  # what each row embeds: a text replaced under its name is embedded again
        # held by a caller across forget/add/neighbours: concurrent add_documents calls on one
        # collection would otherwise interleave their updates
        self.lock = threading.Lock()

    def add(self, named: Mapping[str, str]) -> None:
        """Embed the documents ``{name: text}`` this index does not hold yet (or holds with another text)."""
        self.forget([n for n, t in named.items() if n in self._texts and self._texts[n] != t])
        todo = {n: t for n, t in named.items() if n not in self._rows}
        if not todo:
            return
        vectors = np.asarray(self.embed(list(todo.values())), dtype=np.float32)
        self.vectors = vectors if not self.names else np.concatenate([self.vectors, vectors])
        for name, text in todo.items():
            self._rows[name] = len(self.names)
            self._texts[name] = text
            self.names.append(name)

    def forget(self, names: Sequence[str]) -> None:
        gone = {n for n in names if n in self._rows}
        if not gone:
            return
        keep = [i for i, n in enumerate(self.names) if n not in gone]
        self.names = [self.names[i] for i in keep]
        self.vectors = self.vectors[keep]
        self._rows = {n: i for i, n in enumerate(self.names)}
        for name in gone:
            del self._texts[name]

    def neighbours(self, names: Sequence[str], k: int) -> dict[str, list[str]]:
        """Each of ``names`` (held here): its ``k`` nearest other documents, the farthest first."""
        rows = [self._rows[n] for n in names]
        found = nearest(self.vectors[rows], self.vectors, k, exclude=rows)
        return {name: [self.names[i] for i in reversed(hits)] for name, hits in zip(names, found)}


NeighbourSearch = Callable[[str], Sequence[tuple[str, str]]]
"""A store of the user's own as a neighbour source: a document's text -> the store's documents
nearest to it, nearest first, as ``(module name, text)`` (a vector store's similarity search by
text; the document itself may be among them)."""


def searched_neighbours(records: Sequence[Any], k: int, search: NeighbourSearch) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each record's ``k`` nearest other documents by ``search``, the farthest first, and their
    texts. The store is someone else's: a search that fails, or answers with something that is
    not ``(name, text)`` pairs, leaves that record with no neighbours (it is encoded plain)."""
    chosen: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    for record in records:
        try:
            hits = [(name, text) for name, text in search(record.text)]
            if not all(isinstance(name, str) and isinstance(text, str) and text for name, text in hits):
                raise TypeError("a hit is not a (name, text) pair of non-empty strings")
        except Exception as err:  # noqa: BLE001 - a neighbour source that fails degrades to a plain document
            logger.warning("neighbours of document %r not found (encoded plain): %s: %s", record.name, type(err).__name__, err)
            continue
        kept: list[str] = []
        for name, text in hits:
            if name != record.name and text != record.text and name not in kept and len(kept) < k:
                kept.append(name)
                texts.setdefault(name, text)
        chosen[record.name] = kept[::-1]
    return chosen, texts


def reorder(names: Sequence[str], contexts: Mapping[str, DocumentContext]) -> list[str]:
    """``names`` (a ranking, best first) placed so that each document follows the neighbour it
    was encoded right behind, where the ranking allows.

    Each document's predecessor is the last name of its context (its nearest neighbour) when
    that one is among ``names`` and not taken already; the links form chains, followed from the
    best-ranked chain to the worst (documents with no link are chains of one), each chain led by
    its first member. Linking goes in ranking order, so a better document keeps its predecessor
    when two want the same one; a link that would close a loop is skipped. Where a document's
    whole context precedes it in this order, its KV is what full prefill computes there.
    """
    order = list(names)
    if len(set(order)) != len(order):  # a document imported twice: placed as asked, twice
        return order
    wanted = set(order)
    before: dict[str, str] = {}  # document -> the one placed right before it
    after: dict[str, str] = {}
    for name in order:
        context = contexts.get(name)
        if context is None or not context.names:
            continue
        nearest_name = context.names[-1]
        if nearest_name not in wanted or nearest_name == name or nearest_name in after:
            continue
        head = nearest_name  # would this link close a loop? follow the chain back from the neighbour
        while head in before and head != name:
            head = before[head]
        if head == name:
            continue
        before[name] = nearest_name
        after[nearest_name] = name
    rank = {name: i for i, name in enumerate(order)}
    heads = [n for n in order if n not in before]
    chains: list[list[str]] = []
    for head in heads:
        chain = [head]
        while chain[-1] in after:
            chain.append(after[chain[-1]])
        chains.append(chain)
    chains.sort(key=lambda chain: min(rank[n] for n in chain))
    return [name for chain in chains for name in chain]
