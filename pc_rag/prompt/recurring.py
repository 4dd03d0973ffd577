"""Recurring passages: text that plain prompts paste again and again, learned as documents.

A chain that retrieves from a store of its own and pastes the hits into the prompt ("stuff the
documents") sends text that drop-in (:mod:`pc_rag.prompt.dropin`) can reuse only once it is a
stored module; until then every request prefills it. With ``PromptCache(learn_passages=N)`` the
engine reads each plain prompt it serves as passages: the text between the chat template's
markers, cut at blank lines, and of at least ``min_chars`` characters. A passage that ``N``
prompts of the same scope computed, rather than reused, is queued as a document of that scope's
learned collection (:func:`learned_collection`), encoded in the background behind every document
a caller added, and read by drop-in from then on, with the same recovery as any document.

What is learned stays with whoever pasted it: a request scoped to ``collections`` learns into, and
reads from, a collection named for that scope only (the server gives every API key a scope of its
own, so two keys never see each other's passages, nor their timing). Memory is bounded twice: the
sightings counted (``tracked``, least recently seen forgotten first) and the passages kept per
collection (``kept``, the oldest learned deleted first); their KV lives in the module store under
its memory budget like any document's.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from .. import forks
from ..errors import PromptCacheError

logger = logging.getLogger(__name__)

MIN_CHARS = 200  # ~50 tokens: shorter text costs more in recovery and lookups than its reuse saves
TRACKED = 4096  # passages whose sightings are counted, across scopes
KEPT = 256  # passages learned per collection (~7 MB of float32 KV each for the embedded model: ~1.8 GB at most)

_BLANK_LINE = r"\n[ \t]*\n"
LEARNED = "_learned"


def learned_collection(scope: frozenset[str] | None) -> str:
    """The collection the passages learned under ``scope`` (a request's ``collections``) are kept in."""
    if scope is None:
        return LEARNED
    digest = hashlib.sha256("\n".join(sorted(scope)).encode()).hexdigest()[:24]
    return f"{LEARNED}-{digest}"


def is_learned(collection: str) -> bool:
    """Whether ``collection`` holds learned passages: a replica's own, never published to the shared registry."""
    return collection == LEARNED or collection.startswith(LEARNED + "-")


def splitter(markers: Iterable[str]) -> re.Pattern[str]:
    """What separates passages: blank lines and the chat template's markers (longest first)."""
    texts = sorted({m for m in markers if m}, key=len, reverse=True)
    return re.compile("|".join([*map(re.escape, texts), _BLANK_LINE]))


class RecurringPassages:
    """Counts the passages prompts compute, per learned collection; says which to learn.

    ``after``: the sightings that make a passage worth learning (1: the first).
    """

    def __init__(self, after: int, separators: re.Pattern[str], *, min_chars: int = MIN_CHARS,
                 tracked: int = TRACKED, kept: int = KEPT) -> None:
        if isinstance(after, bool) or not isinstance(after, int) or after < 1:
            raise PromptCacheError(f"learn_passages must be a whole number of prompts (1 or more), got {after!r}", param="learn_passages")
        self.after, self.separators, self.min_chars, self.tracked, self.kept = after, separators, min_chars, tracked, kept
        self._seen: OrderedDict[tuple[str, str], int] = OrderedDict()  # (collection, sha256 of text) -> sightings
        self._learned: dict[str, OrderedDict[str, None]] = {}  # collection -> names learned, oldest first
        self.learned = 0  # passages queued to be learned since start
        self._lock = threading.Lock()
        forks.renew_after_fork(self, "_lock")

    def passages(self, prompt: str) -> list[str]:
        """The passages of ``prompt`` long enough to learn, each once, in order."""
        pieces = (piece.strip() for piece in self.separators.split(prompt))
        return list(dict.fromkeys(piece for piece in pieces if len(piece) >= self.min_chars))

    def sighted(self, collection: str, passages: Iterable[str]) -> list[str]:
        """Count one sighting of each of ``passages`` (computed by a prompt learning into
        ``collection``); return those seen ``after`` times now (counted from zero again)."""
        due = []
        with self._lock:
            for text in passages:
                key = (collection, hashlib.sha256(text.encode()).hexdigest())
                count = self._seen.pop(key, 0) + 1
                if count >= self.after:
                    due.append(text)
                    continue
                self._seen[key] = count  # most recently seen last
                while len(self._seen) > self.tracked:
                    self._seen.popitem(last=False)
        return due

    def keep(self, collection: str, names: Iterable[str]) -> list[str]:
        """Record ``names`` as learned into ``collection``; return the oldest ones past ``kept``,
        which the caller deletes."""
        with self._lock:
            held = self._learned.setdefault(collection, OrderedDict())
            for name in names:
                held.pop(name, None)
                held[name] = None
                self.learned += 1
            return [held.popitem(last=False)[0] for _ in range(max(0, len(held) - self.kept))]


def recurring_passages(after: int | None, spec: Any, tokenizer: Any, drop_in: bool) -> RecurringPassages | None:
    """``PromptCache(learn_passages=after)``'s counter (None: not learning). Learned passages are
    read through drop-in: without it (modules that cannot move, a slow tokenizer) nothing is learned."""
    if after is None:
        return None
    passages = RecurringPassages(after, splitter(_marker_texts(spec, tokenizer)))
    if not drop_in:
        logger.warning("learn_passages=%d: not learning passages, since drop-in cannot reuse them on this model "
                       "(modules that cannot move, or a tokenizer without character offsets)", after)
        return None
    return passages


def _marker_texts(spec: Any, tokenizer: Any) -> list[str]:
    markers = spec.markers
    texts = list(getattr(tokenizer, "all_special_tokens", None) or [])
    if markers is not None:
        texts += [*markers.starts.values(), *markers.ends.values(), markers.generation, markers.no_system]
    return [t for t in texts if isinstance(t, str)]
