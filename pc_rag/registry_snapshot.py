"""What a plan is made against: the schemas the engine holds (:class:`Schema`, with each jointly
encoded module's :class:`JointPath`) and the registry at one moment (:class:`Snapshot`).

All immutable: :class:`pc_rag.registry.Registry` publishes a new snapshot for every change, and
a plan keeps the schemas it was planned against however the registry changes afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from .prompt.documents import DocumentRecord
from .prompt.dropin import IndexSnapshot
from .prompt.layout import SchemaLayout
from .prompt.neighbours import DocumentContext


@dataclass(frozen=True)
class JointPath:
    """Where a jointly encoded module (``encoding="scaffold"``) comes from: the path through the
    schema it was encoded on, and the index in that path of each of its tokens."""

    token_ids: tuple[int, ...] = field(repr=False)
    positions: tuple[int, ...] = field(repr=False)
    index: tuple[int, ...] = field(repr=False)

    @cached_property  # read on every fetch of the module: computed once
    def module_positions(self) -> list[int]:
        """The positions the module's tokens were encoded at (its KV is stored at them)."""
        return [self.positions[i] for i in self.index]


@dataclass(frozen=True)
class Schema:
    """A schema the engine holds: its layout and the store key of each module's KV. Immutable:
    adding documents publishes a new Schema."""

    name: str
    source: str
    layout: SchemaLayout = field(repr=False)
    keys: Mapping[str, str] = field(repr=False)
    # document collections (add_documents): the records by module name, and the system prompt
    documents: Mapping[str, DocumentRecord] = field(default_factory=dict, repr=False)
    system: str | None = None
    # encoding="scaffold": each module's path (modules of one path share its tuples)
    joint: Mapping[str, JointPath] = field(default_factory=dict, repr=False)
    # documents encoded behind neighbours (add_documents(context=...)): what each one read first
    contexts: Mapping[str, DocumentContext] = field(default_factory=dict, repr=False)
    # the same documents' plain variants (behind the system turn only): their store keys, read
    # where a prompt places a document first (pc_rag.planner)
    plain: Mapping[str, str] = field(default_factory=dict, repr=False)
    # neighbours found in a store of the user's own (neighbour_search), not in this collection:
    # their texts, by name (a deletion re-encodes their dependents without them)
    outside: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def modules(self) -> list[str]:
        return self.layout.named_modules()

    @property
    def parameters(self) -> dict[str, dict[str, int]]:
        return {n: {p.name: p.length for p in self.layout.modules[n].params.values()} for n in self.modules}


@dataclass(frozen=True)
class Snapshot:
    """The registry at one moment: what a plan is made against."""

    schemas: Mapping[str, Schema] = field(default_factory=dict)
    index: IndexSnapshot = field(default_factory=IndexSnapshot)
