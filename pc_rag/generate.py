"""The passes, in the spirit of gpt-fast's ``generate.py``: :func:`prefill`, :func:`decode_one_token`
and :func:`decode`, one loop for 1..n rows.

A request (or a batch of them) arrives here assembled (:mod:`pc_rag.assemble`): its :class:`Rows`
hold the KV each row attends to (its own cache, plus shared KV read in place) with the position
of every cache entry, and its :class:`Inputs` the tokens each row computes. Causality follows
positions, not cache order, so one forward pass computes every token a prompt does not reuse
however many gaps between modules they fill; the masks come from
:func:`pc_rag.attention.attention_mask`. Per-request state (sampling, stops, detokenising,
statistics) lives in :class:`pc_rag.generation.RequestState`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .attention import attention_mask
from .encoder import Forward
from .generation import RequestState
from .kvcache import BufferPool, KVBuffer
from .layout import Plan, Segment
from .model import ModelSpec
from .recovery import Entries, Probe, Recovery, deviation, query_layers, top_entries
from .shared_attention import SharedKV


@dataclass
class Rows:
    """What a batch of rows attends to while it is prefilled and decoded."""

    buffer: KVBuffer  # each row's own KV, [rows, capacity] entries
    key_positions: torch.Tensor  # [rows, capacity] int64: the position of every entry
    valid: torch.Tensor  # [rows, capacity] bool: real entries (not padding)
    shared: SharedKV | None = None  # KV read where it is stored (zero-copy, shared by rows)
    # one row whose cache holds its tokens in position order and nothing else (full prefill, or a
    # model served segment by segment): transformers' own masks are right, and none is passed
    ordered: bool = False
    bias: torch.Tensor | None = None  # [rows, capacity]: added to every query's logits for each entry (APE)
    holes: bool = False  # some entries are masked out (recomputed further on): every step needs a mask

    @property
    def batch(self) -> int:
        return self.buffer.batch


@dataclass
class Inputs:
    """The tokens every row computes, left-padded so that every row's last column is its last token."""

    ids: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # [rows, width]; padding takes its row's first position (it must see some key)
    real: torch.Tensor  # [rows, width] bool: not padding
    bounds: tuple[int, int]  # smallest and largest position (read on the host, never from the device)

    @classmethod
    def left_padded(cls, sequences: Sequence[tuple[Sequence[int], Sequence[int]]], placeholder_id: int, device: torch.device) -> Inputs:
        """Rows of ``(token ids, positions)`` (each in position order), left-padded to one width."""
        width = max(len(row_ids) for row_ids, _ in sequences)
        batch = len(sequences)
        ids = torch.full((batch, width), placeholder_id, dtype=torch.long)
        positions = torch.zeros(batch, width, dtype=torch.long)
        real = torch.zeros(batch, width, dtype=torch.bool)
        for row, (row_ids, row_positions) in enumerate(sequences):
            pad = width - len(row_ids)
            ids[row, pad:] = torch.as_tensor(row_ids)
            positions[row, pad:] = torch.as_tensor(row_positions)
            positions[row, :pad] = int(row_positions[0])  # padding queries see what the row's first token sees: no NaN
            real[row, pad:] = True
        low = min(int(p[0]) for _, p in sequences)
        high = max(int(p[-1]) for _, p in sequences)
        return cls(ids.to(device), positions.to(device), real.to(device), (low, high))


def prefill(forward: Forward, rows: Rows, inputs: Inputs, spec: ModelSpec) -> torch.Tensor:
    """Every row's computed tokens in one forward pass; the logits of each row's last token, ``[rows, vocab]``."""
    mask = _place(rows, inputs, spec)
    return forward.prefill_batch(rows.buffer, inputs.ids, inputs.positions, mask, rows.shared, inputs.bounds)


def _place(rows: Rows, inputs: Inputs, spec: ModelSpec) -> Any:
    """Record where ``inputs`` go in the rows' cache (after what it holds); their attention mask."""
    start = len(rows.buffer)
    end = start + inputs.ids.shape[1]
    rows.key_positions[:, start:end] = inputs.positions
    rows.valid[:, start:end] = inputs.real
    if rows.ordered:
        return None
    return attention_mask(inputs.positions, rows.key_positions[:, :end], rows.valid[:, :end], spec, rows.bias)


# ---------------------------------------------------------------------------------------------
# Scored recovery (see pc_rag.recovery): choose cached entries with a short pass, recompute them
# ---------------------------------------------------------------------------------------------
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
        mask = _place(rows, inputs, spec)
        forward.probe(rows.buffer, inputs.ids, inputs.positions, mask, probe)
        assert probe.scores is not None
        scores = probe.scores
    else:
        scores = _deviation(forward, rows, plans, found, min(recovery.check_layer, spec.layers - 1), scratch)
    chosen = top_entries(scores, found, recovery)
    if recovery.adjusts_attention:
        adjust_attention(rows, found.candidate, recovery.temperature, recovery.scale)
    return prefill_selected(forward, rows, inputs, found.token_ids, chosen, spec), [len(c) for c in chosen]


def adjust_attention(rows: Rows, moved: torch.Tensor, temperature: float, scale: float) -> None:
    """APE (arXiv:2502.05431): computed queries attend to the moved cached entries ``moved
    [rows, width]`` (the first ``width`` of each row's cache) with logits divided by
    ``temperature`` (their keys are scaled, in this request's copy) and weighted by ``scale``
    (``log scale`` added to their logits)."""
    width = moved.shape[1]
    moved = moved.to(rows.valid.device)
    if temperature != 1.0:  # keys [layers, rows, heads, width, dim], each moved entry's divided by T
        factor = torch.where(moved, 1.0 / temperature, 1.0).to(rows.buffer.storage.dtype)
        rows.buffer.storage[:, 0, :, :, :width].mul_(factor[None, :, None, :, None])
    if scale != 1.0:
        bias = torch.zeros(rows.valid.shape, dtype=torch.float32, device=rows.valid.device)
        bias[:, :width][moved] = math.log(scale)
        rows.bias = bias


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


def prefill_in_order(
    forward: Forward, rows: Rows, plan: Plan, append_cached: Callable[[KVBuffer, Plan, Segment], None]
) -> torch.Tensor:
    """One row, segment by segment in prompt order: cached KV appended, computed runs forwarded.

    For models whose attention reads cache order (ALiBi, learned positions) or takes no custom
    mask (flash, flex): one forward pass per run of computed text.
    """
    logits: torch.Tensor | None = None
    ids: list[int] = []
    positions: list[int] = []
    last = len(plan.segments) - 1
    for index, segment in enumerate(plan.segments):
        at = len(rows.buffer)
        span = torch.arange(segment.position, segment.position + len(segment))
        if segment.cached:
            append_cached(rows.buffer, plan, segment)
            rows.key_positions[0, at : at + len(segment)] = span
            rows.valid[0, at : at + len(segment)] = True
            continue
        ids.extend(segment.token_ids)
        positions.extend(span.tolist())
        if index == last or plan.segments[index + 1].cached:
            first = len(rows.buffer)
            rows.key_positions[0, first : first + len(ids)] = torch.tensor(positions)
            rows.valid[0, first : first + len(ids)] = True
            logits = forward(rows.buffer, ids, positions, logits=index == last)
            ids, positions = [], []
    assert logits is not None  # a plan's last segment is computed (layout.compute_last)
    return logits[None]


def decode_one_token(forward: Forward, rows: Rows, tokens: Sequence[int], positions: Sequence[int], spec: ModelSpec) -> torch.Tensor:
    """Feed one token per row at ``positions``; the next logits, ``[rows, vocab]``."""
    column = len(rows.buffer)
    # one tensor of positions: the new keys' positions and the queries' are the same
    rows.key_positions[:, column] = torch.tensor(list(positions), device=rows.key_positions.device)
    rows.valid[:, column] = True  # finished rows feed a placeholder nobody reads
    query = rows.key_positions[:, column : column + 1]
    mask = None
    # one row's new token comes after every key, so only padding or a window needs a mask
    if rows.batch > 1 or rows.holes or rows.bias is not None or (spec.sliding_window is not None and not rows.ordered):
        mask = attention_mask(query, rows.key_positions[:, : column + 1], rows.valid[:, : column + 1], spec, rows.bias)
    return forward.decode_batch(rows.buffer, tokens, query, (min(positions), max(positions)), mask, rows.shared)


def decode(
    forward: Forward, rows: Rows, requests: Sequence[RequestState], logits: torch.Tensor, spec: ModelSpec
) -> Generator[list[str], None, None]:
    """The decode loop: every row's next token from ``logits``, fed back until every request is
    done. Yields each step's new text, one string per row."""
    feeding: list[int | None] = [0] * len(requests)  # every row takes the prefill's logits
    while True:
        feeding, deltas = _take(requests, logits, feeding)
        yield deltas
        if all(token is None for token in feeding):
            return
        positions = [request.next_position for request in requests]
        ids = [token if token is not None else spec.placeholder_id for token in feeding]
        logits = decode_one_token(forward, rows, ids, positions, spec)
        for request in requests:
            request.next_position += 1


def _take(requests: Sequence[RequestState], logits: torch.Tensor, feeding: list[int | None]) -> tuple[list[int | None], list[str]]:
    """Each live row's next token; greedy rows read their argmax in one host transfer per step."""
    greedy = logits.argmax(-1).tolist() if any(r.greedy for r in requests) else [None] * len(requests)
    tokens: list[int | None] = []
    deltas: list[str] = []
    for row, request in enumerate(requests):
        if feeding[row] is None or request.done:
            tokens.append(None)
            deltas.append("")
            continue
        token, delta = request.take(logits[row], greedy[row])
        tokens.append(token)
        deltas.append(delta)
    return tokens, deltas
