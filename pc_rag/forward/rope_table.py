"""The C decode step's cos and sign-folded sin by position (:mod:`pc_rag.forward.fused_step`), computed
by the model's own rotary module once per block of positions instead of at every step.

Why: a step's Python runs on caches the C step has just flushed (it streams ~170 MB), so each
torch op costs ~20-40 us there. The rotary call and its reshapes were ~13 of them and 0.10-0.15 ms
a step on the embedded model; two ``index_select`` calls replace them.

The module's own values: the table is its output for positions in blocks of ``BLOCK``, as a
prefill's call over many positions gives them, and every op in it (a product, ``cat``, ``cos``,
``sin``, the attention scaling) works element by element. A block's ``BLOCK x dim`` elements are
whole SIMD vectors and below torch's grain for splitting an op across threads. Where a position's
``dim`` values fill whole vectors too (heads of 64 and 128: the embedded model's), a one-position
call runs the same code and gives the same bits; for smaller heads torch computes a short call's
last elements in scalar code, which may differ in the last bit, as two calls of different lengths
may anyway (tests compare both).

Only for rotary modules whose frequencies do not change with the input (``rope_type`` neither
dynamic nor LongRoPE, which rewrite ``inv_freq`` from the positions they are handed); a table is
rebuilt when ``inv_freq`` or the attention scaling changed since it was filled. A module whose
frequencies differ by layer type (Gemma 3's local and global layers: ``rotary(x, positions, layer_type)``,
``{layer_type}_inv_freq``) gets a table per type.
"""

from __future__ import annotations

from typing import Any

import torch

from .rotation import signed_sin

BLOCK = 256  # positions a rotary call fills: 256 x 64 floats, whole vectors and one thread's work


def _prefix(layer_type: str | None) -> str:
    """What the module's attributes for ``layer_type``'s frequencies begin with (Gemma 3's ``sliding_attention_inv_freq``)."""
    return "" if layer_type is None else f"{layer_type}_"


def _static(rotary: Any, layer_type: str | None = None) -> bool:
    """Whether ``rotary``'s cos/sin at a position (for ``layer_type``) do not depend on the other positions it is handed."""
    kind = getattr(rotary, "rope_type", None)
    if layer_type is not None:
        kind = kind.get(layer_type) if isinstance(kind, dict) else None
    return (isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"
            and isinstance(getattr(rotary, f"{_prefix(layer_type)}inv_freq", None), torch.Tensor))


class RopeTable:
    """``rows(positions [rows, 1]) -> (cos, signed_sin)``, each ``[rows, dim]`` contiguous float32, as
    ``rotary(hidden, positions)`` (``rotary(hidden, positions, layer_type)``) followed by
    :func:`~pc_rag.model.rope.signed_sin` gives them. The module's hooks still run: a hooked module
    is called at every step, as before."""

    def __init__(self, rotary: Any, hidden: torch.Tensor, layer_type: str | None = None) -> None:
        self.rotary = rotary
        self.layer_type = layer_type
        self._inv_freq, self._scaling = f"{_prefix(layer_type)}inv_freq", f"{_prefix(layer_type)}attention_scaling"
        self._type = () if layer_type is None else (layer_type,)  # the call's last argument, where the module takes one
        self.like = torch.empty(1, 1, 1, dtype=hidden.dtype, device=hidden.device)  # what the module reads of its input
        # (module key, cos, signed sin): one attribute, replaced whole, so a step on another thread reads one table
        self.table: tuple[tuple[Any, ...], torch.Tensor, torch.Tensor] = ((), torch.empty(0, 0), torch.empty(0, 0))

    @classmethod
    def build(cls, rotary: Any, hidden: torch.Tensor, layer_type: str | None = None) -> RopeTable | None:
        """A table for ``rotary`` (for ``layer_type``'s frequencies; ``hidden``: a float32 CPU tensor like the
        step's), or None where its frequencies follow the input (then the step calls the module)."""
        if not _static(rotary, layer_type) or hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        return cls(rotary, hidden, layer_type)

    def _current(self, key: tuple[Any, ...]) -> tuple[Any, ...]:
        """``key`` if the module's frequencies and scaling are still those it was filled from, else
        the new ones (a copy: compared by value, which also sees a change in place to an
        inference tensor, whose version torch does not count)."""
        inv_freq, scaling = getattr(self.rotary, self._inv_freq), getattr(self.rotary, self._scaling, None)
        if key and key[1] == scaling and key[0].shape == inv_freq.shape and torch.equal(key[0], inv_freq):
            return key
        return inv_freq.detach().clone(), scaling

    def _filled(self, key: tuple[Any, ...], positions: int) -> tuple[tuple[Any, ...], torch.Tensor, torch.Tensor]:
        """A table of positions [0, ``positions``) rounded up to whole blocks."""
        blocks = []
        for start in range(0, positions, BLOCK):
            cos, sin = self.rotary(self.like, torch.arange(start, start + BLOCK)[None], *self._type)
            blocks.append((cos[0], signed_sin(sin[0])))
        cos, sin = (torch.cat(parts).contiguous() for parts in zip(*blocks))
        return key, cos, sin

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The table's rows for ``positions``; None where a hook on the module asks for it to be called."""
        if self.rotary._forward_hooks or self.rotary._forward_pre_hooks:
            return None
        index = positions.reshape(-1)
        key, cos, sin = self.table
        current = self._current(key)
        if current is key:
            try:
                return cos.index_select(0, index), sin.index_select(0, index)
            except IndexError:  # a position past the table: grown below (doubling)
                pass
        needed = int(index.max()) + 1
        self.table = key, cos, sin = self._filled(current, max(needed, 2 * cos.shape[0] if current is key else needed))
        return cos.index_select(0, index), sin.index_select(0, index)
