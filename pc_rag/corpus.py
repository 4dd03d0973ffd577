"""The demo corpus: standard-library documentation, present on any machine with Python.

Each module's docstring (as ``pydoc`` shows it) is split at blank lines into passages of at most
``max_chars`` characters; each passage starts with the module's name, so that it reads (and
embeds) well on its own.
"""

from __future__ import annotations

import importlib
import pydoc
import re
from dataclasses import dataclass

DEMO_MODULES = (
    "json", "csv", "argparse", "sqlite3", "re", "itertools", "collections", "heapq",
    "subprocess", "random", "statistics", "copy", "hashlib", "uuid", "tempfile", "struct",
)  # fmt: skip


@dataclass(frozen=True)
class Passage:
    id: str
    text: str
    metadata: dict


def stdlib_corpus(modules: tuple[str, ...] = DEMO_MODULES, max_chars: int = 1000) -> list[Passage]:
    """Passages of the documentation of ``modules``, in order; ids like ``json-0``."""
    passages: list[Passage] = []
    for name in modules:
        doc = pydoc.getdoc(importlib.import_module(name)).strip()
        chunks: list[str] = []
        for block in re.split(r"\n\s*\n", doc):
            block = block.strip()
            if chunks and len(chunks[-1]) + len(block) + 2 <= max_chars:
                chunks[-1] += "\n\n" + block
            elif block:
                chunks.extend(block[i : i + max_chars] for i in range(0, len(block), max_chars))
        for index, chunk in enumerate(chunks):
            passages.append(Passage(f"{name.replace('.', '_')}-{index}", f"Python module {name}: {chunk}", {"python_module": name, "part": index}))
    return passages
