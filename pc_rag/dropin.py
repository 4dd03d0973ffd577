"""Drop-in reuse: find the verbatim text of stored modules inside a plain prompt.

An unchanged "stuff the documents into the prompt" chain sends the documents' text, not module
references. To reuse their KV the engine must find that text, and it must not compare the prompt
with every stored module: with 10,000 modules that is 10,000 substring searches per call.

The index keys every module by the first ``KEY_CHARS`` characters of its text and puts the keys
in an Aho-Corasick automaton (``pyahocorasick``, C): one pass over the prompt reports every place
where some module's key occurs, in time linear in the prompt plus matches, whatever the number of
modules. Each candidate is then confirmed by comparing the module's whole text in place. Modules
shorter than ``KEY_CHARS`` are not indexed: their KV is too small to be worth the risk of a
coincidental match.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

import ahocorasick

KEY_CHARS = 32


@dataclass(frozen=True)
class TextMatch:
    start: int
    end: int
    schema: str
    name: str


class ModuleTextIndex:
    """Verbatim module texts, searchable in a prompt in one linear pass."""

    def __init__(self) -> None:
        # key -> [(schema, name, text)]: modules whose texts share their first KEY_CHARS characters
        self._entries: dict[str, list[tuple[str, str, str]]] = {}
        self._automaton: ahocorasick.Automaton | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return sum(len(v) for v in self._entries.values())

    def add(self, schema: str, name: str, text: str) -> bool:
        """Index one module's text; returns False when the text is too short to index."""
        if len(text) < KEY_CHARS:
            return False
        with self._lock:
            bucket = self._entries.setdefault(text[:KEY_CHARS], [])
            if (schema, name, text) not in bucket:
                bucket.append((schema, name, text))
                self._automaton = None  # rebuilt on the next search
        return True

    def remove_schema(self, schema: str) -> None:
        with self._lock:
            for key in list(self._entries):
                kept = [e for e in self._entries[key] if e[0] != schema]
                if kept:
                    self._entries[key] = kept
                else:
                    del self._entries[key]
            self._automaton = None

    def _built(self) -> ahocorasick.Automaton | None:
        with self._lock:
            if self._automaton is None and self._entries:
                automaton = ahocorasick.Automaton()
                for key, bucket in self._entries.items():
                    # the automaton holds a snapshot of each bucket, so a search never reads
                    # ``_entries`` while another thread adds to it
                    automaton.add_word(key, tuple(bucket))
                automaton.make_automaton()
                self._automaton = automaton
            return self._automaton

    def find(self, text: str, schemas: Iterable[str] | None = None) -> list[TextMatch]:
        """Non-overlapping occurrences of module texts in ``text``, left to right.

        Where candidates overlap, the one starting first wins, then the longest.
        """
        automaton = self._built()
        if automaton is None:
            return []
        allowed = set(schemas) if schemas is not None else None
        matches: list[TextMatch] = []
        covered = 0  # everything before this index belongs to an accepted match
        for end, bucket in automaton.iter(text):
            start = end - KEY_CHARS + 1
            if start < covered:
                continue
            best: tuple[str, str, str] | None = None
            for entry in bucket:
                schema, _, body = entry
                if allowed is not None and schema not in allowed:
                    continue
                if (best is None or len(body) > len(best[2])) and text.startswith(body, start):
                    best = entry
            if best is not None:
                matches.append(TextMatch(start, start + len(best[2]), best[0], best[1]))
                covered = start + len(best[2])
        return matches
