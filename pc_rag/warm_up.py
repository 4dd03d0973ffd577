"""Compile the decode step before the first caller arrives.

Under ``compile`` the scheduler's decode step runs through ``torch.compile``: the first step at a
new shape compiles (seconds on a GPU, ten or more on a CPU), a second batch size or capacity
compiles once more with that size symbolic, and under "reduce-overhead" every (rows, capacity)
records a CUDA graph. Served as they come, those compilations land on the first callers' requests.
:func:`warm_up` runs them at start-up instead, the way vLLM and SGLang capture their CUDA graphs
before they take traffic: a few throwaway greedy requests through the engine's own scheduler, so
the steps compiled are exactly the ones served.

What it walks: every batch size the scheduler pads a compiled batch to (powers of two up to
``max_running``, :func:`pc_rag.scheduler.vacant_rows`), starting from a lone row (torch
specializes a size of one: a lone row's graph is its own; the second size makes the rows
symbolic). The capacity is symbolic from the first compilation
(:meth:`pc_rag.kv.buffers.KVBuffer.mark_dynamic_capacity`) and every compiled step's mask is
additive whether or not its rows carry APE's bias (:func:`pc_rag.decode.loop.decode_one_token`),
so plain warm-up prompts compile the graphs RAG prompts of any length run. Under
"reduce-overhead" each new capacity still records a CUDA graph when it first comes (a recording,
not a compilation; what it costs on a GPU is not measured yet). A size whose requests the buffer budget refuses is left
out, logged; it is served all the same and compiled when it first comes. Eagerly, one short
request settles first-call allocations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .errors import PromptCacheError

logger = logging.getLogger(__name__)

PROMPT = "A warm-up request."  # plain text: the steps it compiles are the ones RAG prompts run (see above)


@dataclass
class WarmUp:
    """What :func:`warm_up` ran: ``seconds`` in all, the decode ``shapes`` (rows, capacity) the
    compiled step has run at afterwards (a CUDA graph each under "reduce-overhead"), and the
    batch sizes ``left_out`` because their requests did not fit the buffer budget."""

    seconds: float
    shapes: list[tuple[int, int]]
    left_out: list[int] = field(default_factory=list)


def batch_sizes(max_running: int) -> list[int]:
    """The row counts a compiled batch is padded to: powers of two below ``max_running``, and it."""
    return sorted({1 << i for i in range(max_running.bit_length()) if 1 << i < max_running} | {max_running})


def warm_up(engine: Any, *, new_tokens: int = 3) -> WarmUp:
    """Compile (and under "reduce-overhead" record) the decode step of ``engine`` (a
    :class:`pc_rag.PromptCache`; :meth:`pc_rag.serving.Serving.warm_up` calls this) for the shapes
    its scheduler will serve; see the module docstring. Each request decodes ``new_tokens``."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 2:
        raise PromptCacheError(f"warm_up's new_tokens must be an integer >= 2 (the first token is prefill's), got {new_tokens!r}")
    started = time.perf_counter()
    if not engine.forward.compiled:
        engine.generate(PROMPT, max_new_tokens=1, do_sample=False)
        return WarmUp(time.perf_counter() - started, [])
    # greedy, and no end of turn before new_tokens: every run reaches decode steps
    settings: dict[str, Any] = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    left_out: list[int] = []
    for rows in batch_sizes(engine.scheduler.limits.max_running):
        try:
            if rows == 1:
                engine.generate(PROMPT, **settings)
            else:
                engine.generate_batch([PROMPT] * rows, **settings)
        except PromptCacheError as err:  # refused (the buffer budget): compiled when such a batch first comes
            logger.warning("warm-up: %d rows left out: %s", rows, err)
            left_out.append(rows)
    seconds = time.perf_counter() - started
    shapes = sorted(engine.forward.compiled_shapes)
    logger.info("warm-up: decode step compiled for %d shapes in %.1f s", len(shapes), seconds)
    return WarmUp(seconds, shapes, left_out)
