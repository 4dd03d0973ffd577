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

from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from .attention import attention_mask
from .encoder import Forward
from .generation import RequestState
from .kvcache import KVBuffer
from .layout import Plan, Segment
from .model import ModelSpec
from .rows import Inputs, Rows


def prefill(forward: Forward, rows: Rows, inputs: Inputs, spec: ModelSpec) -> torch.Tensor:
    """Every row's computed tokens in one forward pass; the logits of each row's last token, ``[rows, vocab]``."""
    mask = place_inputs(rows, inputs, spec)
    return forward.prefill_batch(rows.buffer, inputs.ids, inputs.positions, mask, rows.shared, inputs.bounds)


def place_inputs(rows: Rows, inputs: Inputs, spec: ModelSpec) -> Any:
    """Record where ``inputs`` go in the rows' cache (after what it holds); their attention mask."""
    start = len(rows.buffer)
    end = start + inputs.ids.shape[1]
    rows.key_positions[:, start:end] = inputs.positions
    rows.valid[:, start:end] = inputs.real
    if rows.ordered:
        return None
    return attention_mask(inputs.positions, rows.key_positions[:, :end], rows.valid[:, :end], spec, rows.bias)


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
