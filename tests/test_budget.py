"""The KV buffers' memory budget (pc_rag.kv.budget): its byte rules, what it holds, its answers.

Real buffers from a real pool over a tiny Llama; the scheduler's own use of it (200 requests
under a budget, the pool's idle buffers let go) is tested in tests/test_scheduler.py.
"""

from __future__ import annotations

import pytest

from pc_rag.kv.budget import BufferBudget
from pc_rag.kv.buffers import BATCH_GRANULARITY, BufferPool, KVBuffer


@pytest.fixture
def pool(make_tiny):
    return BufferPool(make_tiny("llama"), granularity=64)


def per_token(pool: BufferPool) -> int:
    one = pool.acquire(1)
    try:
        return one.storage.nbytes // one.capacity
    finally:
        pool.release(one)


def test_a_rows_bytes_follow_the_pools_rounding_and_a_batchs_the_batch_granularity(pool):
    per = per_token(pool)
    budget = BufferBudget(pool, per, None)
    assert budget.bytes_for(1, 65) == 128 * per  # the pool's granularity (64)
    buffer = pool.acquire(65)
    assert buffer.storage.nbytes == budget.bytes_for(1, 65)  # what the pool allocates, exactly
    assert budget.bytes_for(3, 65) == 3 * BATCH_GRANULARITY * per
    padded = BufferBudget(pool, per, None, vacant=lambda rows: 4 - rows)  # a compiled batch padded to 4 rows
    assert padded.batch_bytes(3, 65) == 4 * BATCH_GRANULARITY * per
    assert padded.needs(3, 65) == 3 * BATCH_GRANULARITY * per + 4 * BATCH_GRANULARITY * per  # its own, then its padded copy
    assert budget.needs(3, 65) == 3 * BATCH_GRANULARITY * per


def test_held_buffers_are_counted_live_and_a_pooled_one_goes_back_to_the_pool(pool):
    per = per_token(pool)
    budget = BufferBudget(pool, per, None)
    row = pool.acquire(64)
    batch = KVBuffer.for_model(pool.model, 256, batch=2)
    budget.hold(row, pooled=True)
    budget.hold(batch)
    assert budget.held_bytes(idle=False) == row.storage.nbytes + batch.storage.nbytes
    assert budget.peak >= budget.held_bytes(idle=False)
    idle_before = pool.idle
    budget.release(row)
    assert pool.idle == idle_before + 1  # back to the pool, counted as idle now
    assert budget.held_bytes(idle=False) == batch.storage.nbytes
    assert budget.held_bytes() == batch.storage.nbytes + pool.idle_bytes
    budget.release(batch)
    budget.release(batch)  # twice: nothing more happens
    assert pool.idle == idle_before + 1 and budget.held() == []


def test_a_widened_buffer_is_counted_at_its_new_width(make_tiny):
    model = make_tiny("llama")
    pool = BufferPool(model)
    buffer = KVBuffer(2, 2, 16, 64, dtype=model.dtype, device=model.device, batch=1, reserve=3)
    budget = BufferBudget(pool, 1, None)
    budget.hold(buffer)
    per_row = budget.held_bytes(idle=False)
    buffer.widen(3)
    assert budget.held_bytes(idle=False) == 3 * per_row
    budget.track()
    assert budget.peak == 3 * per_row + pool.idle_bytes


def test_admission_counts_the_cohort_and_the_merged_batch_and_idle_buffers_give_way(pool):
    per = per_token(pool)
    row_bytes = pool.capacity_for(100) * per  # one row of 100 entries: 128 entries
    batch_bytes = 3 * BATCH_GRANULARITY * per  # the merged batch: 3 rows of up to 256 entries
    budget = BufferBudget(pool, per, row_bytes + batch_bytes)
    assert budget.admits(1, 100, None)
    assert budget.admits(1, 100, (3, 200))  # exactly the limit
    assert not budget.admits(1, 100, (3, 300))  # the merged batch needs 3 rows of 512
    running = pool.acquire(64)
    budget.hold(running, pooled=True)
    assert not budget.admits(1, 100, (3, 200))  # the running batch's buffer is held beside them
    budget.release(running)  # now an idle buffer of the pool: it stands in the way only as a cache
    assert pool.idle_bytes > 0
    assert budget.admits(1, 100, (3, 200))
    assert pool.idle_bytes == 0  # let go to make room


def test_a_rebuild_fits_only_beside_what_is_held(pool):
    per = per_token(pool)
    budget = BufferBudget(pool, per, 2 * BATCH_GRANULARITY * per)
    assert budget.rebuild_fits(2, BATCH_GRANULARITY)
    assert not budget.rebuild_fits(3, BATCH_GRANULARITY)
    held = KVBuffer.for_model(pool.model, BATCH_GRANULARITY, batch=1)
    budget.hold(held)
    assert not budget.rebuild_fits(2, BATCH_GRANULARITY)
    assert budget.rebuild_fits(1, BATCH_GRANULARITY)
    assert BufferBudget(pool, per, None).rebuild_fits(1000, 10**6)  # no limit: always
