"""The prefill passes: :func:`prefill` (one forward pass over assembled rows), its chunks
(:func:`chunks_of`, a chunk beside a decode step: :func:`new_tokens`), its in-order form, and
:func:`place_inputs`.

A request (or a batch of them) arrives here assembled (:mod:`pc_rag.prefill.assemble`): its :class:`Rows`
hold the KV each row attends to (its own cache, plus shared KV read in place) with the position
of every cache entry, and its :class:`Inputs` the tokens each row computes. Causality follows
positions, not cache order, so one forward pass computes every token a prompt does not reuse
however many gaps between modules they fill; the masks come from
:func:`pc_rag.forward.attention.attention_mask`. The decode loop that follows is :mod:`pc_rag.decode.loop`.
"""


from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..forward.attention import attention_mask
from ..forward.forward import Forward, NewTokens
from ..kv.buffers import KVBuffer
from ..model.spec import ModelSpec
from ..prompt.plan import Plan, Segment
from .rows import Inputs, Rows


def prefill(forward: Forward, rows: Rows, inputs: Inputs, spec: ModelSpec) -> torch.Tensor:
    """Every row's computed tokens in one forward pass; the logits of each row's last token, ``[rows, vocab]``."""
    mask = place_inputs(rows, inputs, spec)
    return forward.prefill_batch(rows.buffer, inputs.ids, inputs.positions, mask, rows.shared, inputs.bounds)


def chunks_of(rows: Rows, inputs: Inputs, size: int) -> list[Inputs]:
    """One row's ``inputs`` cut into chunks of ``size`` tokens, in order: prefilled one after another
    (:func:`prefill`, or :func:`new_tokens` beside a decode step), each attends to what the chunks
    before it wrote (causality follows positions), so the result is the one pass's, computed in
    pieces that let other rows decode in between."""
    if rows.batch != 1:
        raise ValueError("chunked prefill takes one row (left padding would leave a chunk's padding queries no key)")
    width = inputs.ids.shape[1]
    chunks = []
    for start in range(0, width, size):
        stop = min(start + size, width)
        positions = inputs.positions[:, start:stop]
        low, high = torch.aminmax(positions)  # one host read per chunk (a chunk is a whole forward pass)
        chunks.append(Inputs(inputs.ids[:, start:stop], positions, inputs.real[:, start:stop], (int(low), int(high))))
    return chunks


def new_tokens(rows: Rows, inputs: Inputs, spec: ModelSpec) -> NewTokens:
    """``inputs`` (a chunk) as one batch of a packed forward pass (:meth:`Forward.packed`): what
    :func:`prefill` runs alone, run beside other batches' tokens."""
    mask = place_inputs(rows, inputs, spec, always=True)  # packed, the tokens are not the last of one sequence
    return NewTokens(rows.buffer, inputs.ids, inputs.positions, mask, rows.shared, inputs.bounds)


def place_inputs(rows: Rows, inputs: Inputs, spec: ModelSpec, *, always: bool = False) -> Any:
    """Record where ``inputs`` go in the rows' cache (after what it holds); their attention mask
    (None for ordered rows, whose causal mask transformers builds, unless ``always``)."""
    start = len(rows.buffer)
    end = start + inputs.ids.shape[1]
    rows.key_positions[:, start:end] = inputs.positions
    rows.valid[:, start:end] = inputs.real
    if rows.ordered and not always:
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
    assert logits is not None  # a plan's last segment is computed (plan.compute_last)
    return logits[None]

