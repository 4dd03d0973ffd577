"""Scored recovery: choose cached entries with a short pass of the model, recompute them.

The strategies (``deviation``, ``query``) are described in :mod:`pc_rag.prefill.recovery`, which calls
:func:`prefill_recovered` for them. Rows arrive copy-assembled (each holds its own copy of its
cached KV, so entries can be masked out one by one); :class:`Entries` lists the candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..forward.forward import Forward
from ..forward.probe import Probe
from ..kv.buffers import BufferPool
from ..model.spec import ModelSpec
from ..prompt.plan import Plan
from .ape import adjust_attention, moved_entries
from .passes import place_inputs, prefill
from .rows import Inputs, Rows

if TYPE_CHECKING:
    from .recovery import Recovery


@dataclass
class Entries:
    """The cached entries of every row of a copy-assembled request, in cache order."""

    token_ids: torch.Tensor  # [rows, width] int64: the token of each entry
    candidate: torch.Tensor  # [rows, width] bool: a moved cached token (recovery may recompute it)
    lengths: list[int]  # real entries per row


def entries(plans: Sequence[Plan], moved: Sequence[Sequence[bool]], order: Sequence[int]) -> Entries:
    """Entries of rows assembled by copy: every cached segment of a row's plan, in plan order."""
    rows = [[(s, flag) for s, flag in zip(plans[i].segments, moved[i]) if s.cached] for i in order]
    candidate = moved_entries([[s for s, _ in row] for row in rows], [[f for _, f in row] for row in rows])
    ids = torch.zeros(candidate.shape, dtype=torch.long)
    for row, pairs in enumerate(rows):
        tokens = [t for s, _ in pairs for t in s.token_ids]
        if tokens:
            ids[row, : len(tokens)] = torch.tensor(tokens)
    return Entries(ids, candidate, [sum(len(s) for s, _ in pairs) for pairs in rows])


def top_entries(scores: torch.Tensor, found: Entries, recovery: Recovery) -> list[torch.Tensor]:
    """Each row's chosen entries (indices into its cache, ascending): the best-scored candidates."""
    chosen = []
    width = found.candidate.shape[1]
    scores = scores[:, :width].float().cpu().masked_fill(~found.candidate, float("-inf"))
    for row in range(scores.shape[0]):
        count = recovery.count(int(found.candidate[row].sum()))
        picked = scores[row].topk(count).indices if count else torch.zeros(0, dtype=torch.long)
        chosen.append(picked.sort().values)
    return chosen


def query_layers(recovery: Recovery, layers: int) -> int:
    """How many layers the question's attention is read from."""
    wanted = recovery.query_layers if recovery.query_layers is not None else max(2, layers // 3)
    return max(1, min(layers, wanted))


def deviation(probe_keys: torch.Tensor, cached_keys: torch.Tensor) -> torch.Tensor:
    """Squared distance between recomputed and cached keys per token: ``[heads, n, dim]`` x2 -> ``[n]``."""
    return (probe_keys.float() - cached_keys.float()).pow(2).sum(dim=(0, 2))


def prefill_recovered(
    forward: Forward, rows: Rows, inputs: Inputs, plans: Sequence[Plan], found: Entries, recovery: Recovery,
    spec: ModelSpec, scratch: BufferPool,
) -> tuple[torch.Tensor, list[int]]:
    """Prefill copy-assembled rows, recomputing the cached entries ``recovery`` chooses (``found``
    lists them per row); the logits and how many entries each row recomputed.

    ``plans`` are the rows' plans in row order; ``scratch`` lends the deviation probe its buffer.
    """
    if recovery.strategy == "query":
        probe = Probe(query_layers(recovery, spec.layers) - 1, query_weight=inputs.real.float())
        mask = place_inputs(rows, inputs, spec)
        forward.probe(rows.buffer, inputs.ids, inputs.positions, mask, probe)
        assert probe.scores is not None
        scores = probe.scores
    else:
        scores = _deviation(forward, rows, plans, found, min(recovery.check_layer, spec.layers - 1), scratch)
    chosen = top_entries(scores, found, recovery)
    if recovery.adjusts_attention:
        adjust_attention(rows, found.candidate, recovery.temperature, recovery.scale)
    return prefill_selected(forward, rows, inputs, found.token_ids, chosen, spec), [len(c) for c in chosen]


def _deviation(forward: Forward, rows: Rows, plans: Sequence[Plan], found: Entries, check: int,
               scratch: BufferPool) -> torch.Tensor:
    """CacheBlend's score: each row's whole prompt through layers ``0..check`` (full attention),
    the distance of its keys at ``check`` from the cached ones. The exact KV of those layers then
    replaces the cached KV of every entry (it was computed for all of them)."""
    storage = rows.buffer.storage
    scores = torch.zeros(found.candidate.shape, dtype=torch.float32)
    for row, plan in enumerate(plans):
        n = found.lengths[row]
        if not n:
            continue
        ids, positions = plan.input_ids, plan.position_ids
        buffer = scratch.acquire(len(ids))
        try:
            forward.probe(buffer, torch.tensor([ids]), torch.tensor([positions]), None, Probe(check))
            # the probe holds the prompt in prompt order: find each cache entry's token by its position
            where = torch.full((max(positions) + 1,), -1, dtype=torch.long)
            where[torch.tensor(positions)] = torch.arange(len(positions))
            index = where[rows.key_positions[row, :n].cpu()].to(storage.device)
            exact = buffer.storage[: check + 1, :, 0].index_select(3, index)  # [check+1, 2, heads, n, dim]
            scores[row, :n] = deviation(exact[check, 0], storage[check, 0, row, :, :n]).cpu()
            storage[: check + 1, :, row, :, :n] = exact
        finally:
            scratch.release(buffer)
    return scores


def prefill_selected(forward: Forward, rows: Rows, inputs: Inputs, token_ids: torch.Tensor, chosen: Sequence[torch.Tensor],
                     spec: ModelSpec) -> torch.Tensor:
    """Recompute the cache entries ``chosen`` (per row) together with the rows' computed tokens,
    in one forward pass: the stale entries are masked out, the recomputed tokens appended after
    the cache at their own positions. The logits of each row's last token."""
    real, ids, positions = inputs.real.cpu(), inputs.ids.cpu(), inputs.positions.cpu()
    key_positions = rows.key_positions.cpu()
    sequences = []
    for row, picked in enumerate(chosen):
        row_ids = torch.cat([token_ids[row, picked], ids[row][real[row]]])
        row_positions = torch.cat([key_positions[row, picked], positions[row][real[row]]])
        order = row_positions.argsort()
        sequences.append((row_ids[order], row_positions[order]))
        rows.valid[row, picked.to(rows.valid.device)] = False
    rows.holes = True
    selected = Inputs.left_padded(sequences, spec.placeholder_id, inputs.ids.device)
    return prefill(forward, rows, selected, spec)
