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

Adding to an automaton means building it again, which takes ~30 ms at 10,000 modules. So the
index has two levels, like a log-structured store: a large *base* automaton rebuilt rarely, and
a small *recent* one rebuilt when modules are added; recent entries merge into the base once
they are a sixteenth of it. Searches read an immutable :class:`IndexSnapshot`, published whole
by the writer: a search never waits for a build and never sees one half done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import ahocorasick

from .. import forks

KEY_CHARS = 32
# recent entries merge into the base level past max(MERGE_MIN, base / MERGE_FRACTION)
MERGE_MIN = 256
MERGE_FRACTION = 16

Entry = tuple[str, str, str]  # (schema, module name, text)


@dataclass(frozen=True)
class TextMatch:
    start: int
    end: int
    schema: str
    name: str


def _automaton(buckets: Mapping[str, list[Entry]]) -> ahocorasick.Automaton | None:
    if not buckets:
        return None
    automaton = ahocorasick.Automaton()
    for key, bucket in buckets.items():
        automaton.add_word(key, tuple(bucket))  # a snapshot of the bucket: later adds do not show through
    automaton.make_automaton()
    return automaton


@dataclass(frozen=True)
class IndexSnapshot:
    """The module texts indexed at one moment; immutable, safe to search from any thread."""

    automata: tuple[ahocorasick.Automaton, ...] = ()

    def find(self, text: str, schemas: Iterable[str] | None = None) -> list[TextMatch]:
        """Non-overlapping occurrences of module texts in ``text``, left to right.

        Where candidates overlap, the one starting first wins, then the longest.
        """
        if not self.automata:
            return []
        allowed = set(schemas) if schemas is not None else None
        if len(self.automata) == 1:
            candidates = list(self.automata[0].iter(text))
        else:
            by_end: dict[int, list[Entry]] = {}
            for automaton in self.automata:
                for end, bucket in automaton.iter(text):
                    by_end.setdefault(end, []).extend(bucket)
            candidates = sorted(by_end.items())
        matches: list[TextMatch] = []
        covered = 0  # everything before this index belongs to an accepted match
        for end, bucket in candidates:
            start = end - KEY_CHARS + 1
            if start < covered:
                continue
            best: Entry | None = None
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


class ModuleTextIndex:
    """Verbatim module texts, searchable in a prompt in one linear pass (see module docstring).

    Writers call :meth:`add` / :meth:`remove_schema`; :meth:`snapshot` publishes what they
    changed (building only the recent level, or merging when it has grown) and returns the
    immutable view that :meth:`find` searches.
    """

    def __init__(self) -> None:
        # key -> entries whose texts share their first KEY_CHARS characters, per level
        self._base: dict[str, list[Entry]] = {}
        self._recent: dict[str, list[Entry]] = {}
        self._base_automaton: ahocorasick.Automaton | None = None
        self._recent_count = 0
        self._base_count = 0
        self._snapshot = IndexSnapshot()
        self._dirty = False
        self._lock = threading.Lock()
        forks.renew_after_fork(self, "_lock")

    def __len__(self) -> int:
        return self._base_count + self._recent_count

    def add(self, schema: str, name: str, text: str) -> bool:
        """Index one module's text; returns False when the text is too short to index."""
        if len(text) < KEY_CHARS:
            return False
        entry = (schema, name, text)
        key = text[:KEY_CHARS]
        with self._lock:
            if entry in self._base.get(key, ()) or entry in self._recent.get(key, ()):
                return True
            self._recent.setdefault(key, []).append(entry)
            self._recent_count += 1
            self._dirty = True
        return True

    def remove_schema(self, schema: str) -> None:
        """Forget every module of ``schema``."""
        self._remove(lambda entry: entry[0] == schema)

    def remove(self, schema: str, names: Iterable[str]) -> None:
        """Forget the modules ``names`` of ``schema`` (deleted documents)."""
        gone = set(names)
        self._remove(lambda entry: entry[0] == schema and entry[1] in gone)

    def _remove(self, dropped: Callable[[Entry], bool]) -> None:
        with self._lock:
            for level in (self._base, self._recent):
                for key in list(level):
                    kept = [e for e in level[key] if not dropped(e)]
                    if kept:
                        level[key] = kept
                    else:
                        del level[key]
            self._merge()

    def _merge(self) -> None:
        """Everything into the base level (one full build)."""
        for key, bucket in self._recent.items():
            self._base.setdefault(key, []).extend(bucket)
        self._recent.clear()
        self._base_count = sum(len(b) for b in self._base.values())
        self._recent_count = 0
        self._base_automaton = _automaton(self._base)
        self._dirty = True

    def snapshot(self) -> IndexSnapshot:
        """The current immutable view, built first if texts were added or removed since the last one."""
        with self._lock:
            if self._dirty:
                if self._recent_count > max(MERGE_MIN, self._base_count // MERGE_FRACTION):
                    self._merge()
                recent = _automaton(self._recent)
                self._snapshot = IndexSnapshot(tuple(a for a in (self._base_automaton, recent) if a is not None))
                self._dirty = False
            return self._snapshot

    def find(self, text: str, schemas: Iterable[str] | None = None) -> list[TextMatch]:
        """Search the current snapshot (see :meth:`IndexSnapshot.find`)."""
        return self.snapshot().find(text, schemas)
