"""The prefill path, top to bottom: plans -> assembled rows (:mod:`pc_rag.prefill.assemble`) ->
recovered entries (:mod:`pc_rag.prefill.recovery`, :mod:`pc_rag.prefill.scored`) -> one prefill
pass (:mod:`pc_rag.prefill.passes`). :func:`prefill_plans` is the one call serving makes."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from ..prompt.plan import Plan
from .ape import Ape
from .passes import prefill, prefill_in_order
from .rows import Prefilled
from .scored import entries, prefill_recovered

if TYPE_CHECKING:
    from ..forward.forward import Forward
    from ..kv.buffers import BufferPool
    from ..model.spec import ModelSpec
    from .assemble import Assembled, Assembler, Assembly, Held

from .recovery import Recovery, moved


def assemble_plain(plans: list[Plan], new_tokens: int, *, use_cache: bool, share: bool, recovery: Recovery, encoding: str,
                   assembler: "Assembler", assembly: "Assembly", spec: "ModelSpec", held: "Held | None" = None
                   ) -> "tuple[Assembled, float] | None":
    """The rows and inputs of ``plans`` where their prefill is one plain pass (APE applied, no
    scored strategy, a model that takes a position mask), with the time assembly ended; None
    where it is not (:func:`prefill_plans` then runs the other passes). The scheduler prefills a
    long prompt from here in chunks."""
    if not spec.one_pass:
        return None
    flags = [list(p.moved) if p.moved is not None else moved(p, encoding) for p in plans]
    # the scored strategy recovers moved cached segments: with none (a prompt whose cached KV all
    # sits where it was encoded, e.g. the system prompt of one computed behind a slow tier) its
    # probe pass would score nothing
    if use_cache and recovery.scored and any(m for p, f in zip(plans, flags) for s, m in zip(p.segments, f) if s.cached):
        return None
    ape = Ape(recovery.temperature, recovery.scale, flags) if use_cache and recovery.adjusts_attention else None
    assembled = assembler.assemble(plans, new_tokens, use_cache=use_cache, assembly=assembly, share=share, ape=ape, held=held)
    return assembled, time.perf_counter()


def prefill_plans(plans: list[Plan], new_tokens: int, *, use_cache: bool, share: bool, recovery: Recovery, encoding: str,
                  assembler: "Assembler", assembly: "Assembly", forward: "Forward", spec: "ModelSpec",
                  buffers: "BufferPool", held: "Held | None" = None) -> Prefilled:
    """Assemble and prefill ``plans`` (room for ``new_tokens`` more per row), applying APE and
    the scored strategy; head and tail were applied when the plans were made (:func:`recover`).
    ``held``: what the running batch these rows join holds, read shared (plain passes only)."""
    if not spec.one_pass:  # attention that reads cache order: one row, segment by segment
        (plan,) = plans
        rows = assembler.empty_row(len(plan.input_ids) + new_tokens)
        if not use_cache:
            plan = Plan([replace(s, owner=None) for s in plan.segments], plan.modules)
        return Prefilled(rows, prefill_in_order(forward, rows, plan, assembler.append), [0], time.perf_counter())
    plain = assemble_plain(plans, new_tokens, use_cache=use_cache, share=share, recovery=recovery, encoding=encoding,
                           assembler=assembler, assembly=assembly, spec=spec, held=held)
    if plain is not None:
        assembled, assembled_at = plain
        return Prefilled(assembled.rows, prefill(forward, assembled.rows, assembled.inputs, spec), assembled.order, assembled_at)
    flags = [list(p.moved) if p.moved is not None else moved(p, encoding) for p in plans]
    # scored recovery: every row holds its own copy of its cached KV, so its entries can be
    # masked out one by one; room for the recomputed tokens, appended after the cache
    room = max(recovery.count(sum(len(s) for s, m in zip(p.segments, f) if m)) for p, f in zip(plans, flags))
    assembled = assembler.assemble(plans, new_tokens + room, use_cache=True, assembly="copy", share=False)
    assembled_at = time.perf_counter()
    ordered = [plans[i] for i in assembled.order]
    found = entries(plans, flags, assembled.order)
    assembled.rows.copies = None  # recovery masks copied entries one by one: no copy stands for its segment
    logits, recomputed = prefill_recovered(forward, assembled.rows, assembled.inputs, ordered, found, recovery, spec, buffers)
    return Prefilled(assembled.rows, logits, assembled.order, assembled_at, recomputed)
