"""One C decode step of the embedded model in isolation: 1 and 8 rows, each with 20 own entries, without and
with 1,024 shared entries read in place by all rows (random KV; medians of 15): what the products and the rest
cost against what attention over shared KV adds.

    python benchmarks/step_split.py
"""

from __future__ import annotations

import statistics
import time

import torch

from pc_rag import PromptCache
from pc_rag.forward import shared_attention
from pc_rag.forward.rotation import RopeRotator
from pc_rag.kv.buffers import KVBuffer


def timed_step(step, model, rows: int, shared: int, own: int = 20, repeats: int = 15) -> float:
    """Median ms of one step of ``rows`` rows over ``own`` entries each and ``shared`` entries they all read."""
    layers, kv_heads = len(step.layers), step.kv_heads
    dim = step.layers[0].q.out_features // step.heads
    buffer = KVBuffer.for_model(model, own + 1, batch=rows)
    buffer.storage.copy_(torch.randn(buffer.storage.shape) * 0.3)
    buffer.grow_to(own)
    buffer.fix(own + 1, torch.tensor([own]))
    part = shared_attention.SharedPart(torch.randn(layers, 2, kv_heads, shared, dim) * 0.3, torch.arange(shared), slice(0, rows))
    kv = shared_attention.SharedKV([part], heads_per_kv=step.heads // kv_heads, dtype=torch.float32, rotator=RopeRotator(model))
    ids, positions = torch.full((rows, 1), 7), torch.full((rows, 1), shared + own)
    mask = torch.ones(rows, 1, 1, own + 1, dtype=torch.bool)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step(ids, positions, mask, buffer.cache, shared=kv.for_queries(positions, (shared + own, shared + own)))
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    engine = PromptCache.from_pretrained()
    step = engine.forward.written_step
    before = step.fused.steps
    for rows in (1, 8):
        for shared in (1, 1024):
            print(f"{rows} rows, {shared} shared entries: {timed_step(step, engine.model, rows, shared):.1f} ms", flush=True)
    print(f"steps run in C: {step.fused.steps - before}")


if __name__ == "__main__":
    main()
